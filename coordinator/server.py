"""Coordinator process: what `atomlog serve coordinator` installs.

- TC partition leases (coordinator/leases.py): each leased TC partition is a TcPartition
  (coordinator/tc_partition.py) around its pure core, logging to `__txn_log-<k>`;
- the CoordinatorService RPCs, routed to the TC partition they name (NOT_COORDINATOR
  names the owner when this process is not it; COORDINATOR_LOADING while loading);
- InitProducerId for idempotent producers (a fresh producer id from the allocator block);
- the marker channel to the partition servers (coordinator/markers.py);
- one-call transactions (CommitTxn): staged through the staging channel
  (coordinator/staging.py), decided in one TC log append.

Every request is validated here before it reaches a core; the core validates the rest
and refuses whole inputs with nothing changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, fields

from atomlog.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, partition_pb2

from coordinator import metrics
from coordinator.core import Limits, OneCallAborted, ProducerIdNeeded, State, TxnSummary
from coordinator.lane import CommitLane
from coordinator.leases import Lease, LeaseManager
from coordinator.markers import MarkerChannel
from coordinator.producer_ids import ProducerIds
from coordinator.records import (
    Decision,
    Session,
    SubscriptionPartition,
    TopicPartition,
    TxnId,
    TxnStream,
    tc_partition_for,
)
from coordinator.routing import PartitionRoutes
from coordinator.staging import StageChannel, StageOrder
from coordinator.tc_partition import Phase, Settings, TcPartition
from coordinator.txn_log import TOPIC as TXN_LOG_TOPIC
from coordinator.txn_log import AppendChannel
from partition_server.cursor_store import validate_subscription_name
from partition_server.copy_link import serve_on_link
from partition_server.record_batch import LENGTH_FIELD_END, check_stageable, parse_header
from services import failpoints
from services.batching import observe_failure
from services.errors import AtomlogError
from services.grpcutil import service_name
from services.logs import event

log = logging.getLogger("atomlog.coordinator")

MAX_ITEMS = 10_000  # targets or verification items per call
MAX_CHAINED_COMMITS = 64  # one-call transactions per CommitTxns call
# coordinator.parallel_commits=auto: a parallel commit once this many one-call commits in
# a row began on the coordinator with no other in flight (Coordinator.commit_in_parallel)
AUTO_QUIET_COMMITS = 16


def _invalid(message: str, **metadata: object) -> AtomlogError:
    return AtomlogError("INVALID_ARGUMENT", message, {k: str(v) for k, v in metadata.items()})


def _item_error(error: AtomlogError | None) -> partition_pb2.ItemError | None:
    if error is None:
        return None
    return partition_pb2.ItemError(reason=error.reason, message=error.message,
                                   metadata={k: str(v) for k, v in error.metadata.items()})


def _txn_id_proto(txn_id: TxnId | None) -> common_pb2.TxnId | None:
    if txn_id is None:
        return None
    return common_pb2.TxnId(tc_partition=txn_id.tc_partition, sequence=txn_id.sequence)


def _session_proto(session: Session | None) -> coordinator_pb2.TransactionalSession | None:
    if session is None:
        return None
    return coordinator_pb2.TransactionalSession(
        transactional_id=session.transactional_id, producer_id=session.producer_id,
        producer_epoch=session.producer_epoch)


def _summary_proto(summary: TxnSummary) -> coordinator_pb2.TransactionSummary:
    session = summary.session
    return coordinator_pb2.TransactionSummary(
        txn_id=_txn_id_proto(summary.txn_id), state=summary.state.value,
        end_cause=summary.end_cause.value, parent_txn_id=_txn_id_proto(summary.parent),
        transactional_id=session.transactional_id if session else "",
        producer_id=session.producer_id if session else 0,
        producer_epoch=session.producer_epoch if session else 0,
        start_unix_ms=summary.start_ms, age_ms=summary.age_ms, timeout_ms=summary.timeout_ms,
        topic_partition_count=summary.topic_partition_count,
        subscription_partition_count=summary.subscription_partition_count,
        child_count=summary.child_count)


def _tp_proto(tp: TopicPartition) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=tp.topic, partition=tp.partition)


def _sp_proto(sp: SubscriptionPartition) -> common_pb2.SubscriptionPartition:
    return common_pb2.SubscriptionPartition(topic=sp.topic, partition=sp.partition,
                                            subscription=sp.subscription)


class Coordinator:
    """The TC partitions this process owns, and what they share."""

    def __init__(self, name: str, tc_partitions: int, routes: PartitionRoutes,
                 markers: MarkerChannel, producer_ids: ProducerIds, limits: Limits,
                 settings: Settings, metadata_store, stager: StageChannel | None = None,
                 one_call_max_bytes: int = 1 << 20):
        self.name = name
        self.stager = stager or StageChannel(routes)
        self.one_call_max_bytes = one_call_max_bytes
        self.log_channel = AppendChannel(routes, settings.log_request_timeout_ms / 1000,
                                         self.stager)
        self.tc_partitions = tc_partitions
        self.routes = routes
        self.markers = markers
        self.producer_ids = producer_ids
        self.limits = limits
        self.settings = settings
        self.metadata_store = metadata_store
        self.partitions: dict[int, TcPartition] = {}
        self.leases: LeaseManager | None = None
        # One-call commits on partitions this process hosts (coordinator/lane.py).
        self.lane = CommitLane(self, _OneCallBegun) if settings.commit_lane else None
        self.one_calls_in_flight = 0  # one-call commits being handled (CommitTxn(s))
        # Topic partitions validated once (`_target`), by (topic, partition): a commit
        # names the same few again and again. At most KNOWN_TARGETS, then started afresh.
        self._known_targets: dict[tuple[str, int], TopicPartition] = {}
        self._commits_begun = 0  # one-call commits begun here, and the last of them that
        self._last_overlap = -AUTO_QUIET_COMMITS  # began with another in flight

    def commit_begins(self, commits: int = 1) -> None:
        """`commits` one-call commits begin (one CommitTxn, or a CommitTxns chain, whose
        commits are in flight together); commit_ends once they are answered."""
        self.one_calls_in_flight += commits
        self._commits_begun += commits
        if self.one_calls_in_flight > 1:
            self._last_overlap = self._commits_begun

    def commit_ends(self, commits: int = 1) -> None:
        self.one_calls_in_flight -= commits

    def commit_in_parallel(self) -> bool:
        """Whether the one-call commit that just began (commit_begins) is a parallel
        commit (coordinator.parallel_commits; docs/coordinator.md, "Parallel commits"):
        always with "on", never with "off"; with "auto" once the last AUTO_QUIET_COMMITS
        commits here, this one included, each began with no other one-call commit in
        flight (and CommitTxn gives the commit lane the commits it takes first). Commits
        that come one at a time (a sequential client) wait for their rounds one after the
        other on idle CPUs, and a parallel commit saves them one. Commits that overlap
        share the servers' CPU, which the extra TC-log append of a parallel commit would
        cost them all (measured: an open loop of 165 small transactions/s from 8 clients
        on the cluster ran slower with it), so they keep two rounds, shared by their group
        commits."""
        mode = self.settings.parallel_commits
        if mode == "on":
            return True
        return mode == "auto" and \
            self._commits_begun - self._last_overlap >= AUTO_QUIET_COMMITS

    # ------------------------------------------------------------ lease callbacks

    async def on_acquired(self, lease: Lease) -> None:
        previous = self.partitions.pop(lease.tc_partition, None)
        if previous is not None:
            await previous.stop("lease taken again")
        partition = TcPartition(
            lease.tc_partition, lease.epoch, lease.log_producer_id,
            coordinator_name=self.name, routes=self.routes, log_channel=self.log_channel,
            markers=self.markers, limits=self.limits, settings=self.settings,
            on_fenced=self.on_fenced, resolver=self.stager.resolve)
        self.partitions[lease.tc_partition] = partition
        partition.start()

    async def on_lost(self, k: int) -> None:
        partition = self.partitions.pop(k, None)
        if partition is not None:
            await partition.stop("lease lost")

    async def on_fenced(self, k: int) -> None:
        if self.leases is not None:
            await self.leases.release(k)

    def cores(self):
        return [p.core for p in list(self.partitions.values()) if p.core is not None]

    # ------------------------------------------------------------ routing

    def check_tc(self, k: int, field: str = "tc_partition") -> int:
        if not 0 <= k < self.tc_partitions:
            raise _invalid(f"{field} {k} is outside 0..{self.tc_partitions - 1}",
                           field=field)
        return k

    async def partition(self, k: int) -> TcPartition:
        self.check_tc(k)
        partition = self.partitions.get(k)
        if partition is not None:
            return partition
        metadata = {"tc_partition": str(k), "owner_server_name": "", "owner_address": ""}
        try:
            lease = (await self.metadata_store.tc_leases()).get(k, {})
            owner = lease.get("coordinator_name", "")
            servers = {s.name: s for s in await self.metadata_store.servers()}
            if owner in servers:
                metadata.update(owner_server_name=owner,
                                owner_address=servers[owner].grpc_address)
        except Exception:  # noqa: BLE001 — the owner hint is best effort
            pass
        raise AtomlogError("NOT_COORDINATOR",
                           f"{self.name} does not own TC partition {k}"
                           + (f"; {metadata['owner_server_name']} does"
                              if metadata["owner_server_name"] else "; no coordinator holds "
                              "it right now (it moves within seconds)"), metadata)

    # ------------------------------------------------------------ conversions

    def txn_id(self, message, field: str) -> TxnId:
        if not message.HasField(field):
            raise _invalid(f"{field} is required", field=field)
        value = getattr(message, field)
        self.check_tc(value.tc_partition, f"{field}.tc_partition")
        if value.sequence == 0:
            raise _invalid(f"{field}.sequence must be positive", field=field)
        return TxnId(value.tc_partition, value.sequence)

    @staticmethod
    def session(message) -> Session | None:
        if not message.HasField("session"):
            return None
        proto = message.session
        try:
            return Session(proto.transactional_id, proto.producer_id, proto.producer_epoch)
        except ValueError as error:
            raise _invalid(f"session: {error}", field="session") from None

    def stream(self, message, k: int) -> TxnStream | None:
        """A request's validated TxnStream (None when unset), which lives on TC partition
        tc_partition_for(name): `k` must be it."""
        if not message.HasField("stream"):
            return None
        try:
            stream = TxnStream(message.stream.name, message.stream.ordinal)
        except ValueError as error:
            raise _invalid(f"stream: {error}", field="stream") from None
        home = tc_partition_for(stream.name, self.tc_partitions)
        if home != k:
            raise _invalid(f"stream {stream.name!r} lives on TC partition {home}, not {k}",
                           field="tc_partition")
        return stream

    async def targets(self, topic_partitions, subscription_partitions):
        """Validated targets: (valid ones, per-item errors aligned with the request)."""
        if len(topic_partitions) + len(subscription_partitions) > MAX_ITEMS:
            raise _invalid(f"at most {MAX_ITEMS} partitions and subscription partitions "
                           "per call")
        topics: list[TopicPartition] = []
        subscriptions: list[SubscriptionPartition] = []
        tp_errors: list[AtomlogError | None] = []
        sp_errors: list[AtomlogError | None] = []
        for proto in topic_partitions:
            target, error = self._target(proto, None)
            if error is _LOOK_UP:
                target, error = await self._looked_up(proto, target)
            tp_errors.append(error)
            if target is not None:
                topics.append(target)
        for proto in subscription_partitions:
            target, error = self._target(proto, proto.subscription)
            if error is _LOOK_UP:
                target, error = await self._looked_up(proto, target)
            sp_errors.append(error)
            if target is not None:
                subscriptions.append(target)
        return topics, subscriptions, tp_errors, sp_errors

    def _target(self, proto, subscription: str | None):
        """(target, None), (None, why), or (target, _LOOK_UP) when the routes' cache does
        not know the topic (`_looked_up` then asks: a coroutine only then, not one per
        partition of every commit). A topic partition validated before is not built and
        checked again, only looked up in the routes' cache once more."""
        if subscription is None:
            key = (proto.topic, proto.partition)
            known = self._known_targets.get(key)
            if known is not None:
                count = self.routes.cached_partition_count(key[0])
                if count is not None and key[1] < count:
                    return known, None
        try:
            target = (TopicPartition(proto.topic, proto.partition) if subscription is None
                      else SubscriptionPartition(proto.topic, proto.partition, subscription))
            if subscription is not None:
                # The partition servers' rule for the name, checked here, before the
                # transaction holds it: a name they refuse made every marker to that
                # server refused (one marker carries all of a transaction's targets on
                # it), so the transaction never completed and held its partitions' max
                # read position for good.
                validate_subscription_name(subscription)
        except ValueError as error:
            return None, _invalid(str(error))
        except AtomlogError as error:
            return None, error
        count = self.routes.cached_partition_count(proto.topic)
        if count is None:
            return target, _LOOK_UP
        answer = _within(proto, target, count)
        if subscription is None and answer[1] is None:
            known = self._known_targets
            if len(known) >= KNOWN_TARGETS:
                known.clear()
            known[key] = target
        return answer

    async def _looked_up(self, proto, target):
        return _within(proto, target, await self.routes.partition_count(proto.topic))


_LOOK_UP = object()  # _target: the topic's partition count is not cached
KNOWN_TARGETS = 65_536  # Coordinator._known_targets


def _within(proto, target, count: int | None):
    """(target, None) when the topic has the partition, else (None, why)."""
    if count is None or proto.partition >= count:
        return None, AtomlogError(
            "UNKNOWN_TOPIC_OR_PARTITION",
            f"{proto.topic}/{proto.partition} does not exist"
            + ("" if count is None else f" (the topic has {count} partitions)"),
            {"topic": proto.topic, "partition": str(proto.partition)})
    return target, None


def _merge(requested: list[AtomlogError | None], core_results) -> list:
    """Per-item results in request order: the shell's refusals, else the core's answers
    (for the items that reached it, in order)."""
    answers = iter(core_results)
    return [error if error is not None else next(answers) for error in requested]


def _as_atomlog_error(error: BaseException) -> AtomlogError:
    """A commit's failure as its answer (anything unexpected is logged, INTERNAL)."""
    if isinstance(error, AtomlogError):
        return error
    log.error("CommitTxns: a commit failed unexpectedly", exc_info=error)
    return AtomlogError("INTERNAL", f"commit failed: {error!r}")


@dataclass(frozen=True)
class _OneCallBegun:
    """A one-call transaction its TC partition has begun (CommitTxn, before staging)."""

    k: int
    partition: TcPartition
    start: object  # core.OneCallStart
    timeout_at: float  # time.monotonic(): the transaction's own timeout
    logged: list = ()  # a parallel commit's Staging append (its futures)

    def deadline(self, context) -> float:
        """Staging's deadline: the transaction's timeout, or the call's if sooner."""
        remaining = _remaining_s(context)
        return self.timeout_at if remaining is None else min(
            self.timeout_at, time.monotonic() + remaining)


def _already_ended(start) -> coordinator_pb2.CommitTxnResponse:
    """CommitTxn's answer for a key whose transaction committed already."""
    return coordinator_pb2.CommitTxnResponse(txn_id=_txn_id_proto(start.txn_id),
                                             state=start.existing.value, already_ended=True)


def _remaining_s(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining - 0.05)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, coordinator: Coordinator, authorizer=None):
        self.c = coordinator
        # services.acl.Authorizer (auth.authorizer=acl): who opened each transaction, which
        # VerifyTxnPartitions tells the partition servers (None: authorization off).
        self.authorizer = authorizer

    async def NewTxn(self, request, context):
        c = self.c
        k = c.check_tc(request.tc_partition)
        parent = c.txn_id(request, "parent_txn_id") if request.HasField("parent_txn_id") else None
        session = c.session(request)
        if parent is not None and parent.tc_partition != k:
            raise _invalid(f"a child must be opened on its parent's TC partition "
                           f"{parent.tc_partition}, not {k}", field="tc_partition")
        if session is not None and session.transactional_id and tc_partition_for(
                session.transactional_id, c.tc_partitions) != k:
            raise _invalid(f"transactional id {session.transactional_id!r} lives on TC "
                           f"partition {tc_partition_for(session.transactional_id, c.tc_partitions)}",
                           field="tc_partition")
        stream = c.stream(request, k)
        # A child's, a session's or a stream's key lives on its TC partition; any other key
        # decides it.
        keyed_by_itself = parent is None and stream is None and not (
            session is not None and session.transactional_id)
        if request.idempotency_key and keyed_by_itself and tc_partition_for(
                request.idempotency_key, c.tc_partitions) != k:
            raise _invalid(f"idempotency key {request.idempotency_key!r} lives on TC "
                           f"partition {tc_partition_for(request.idempotency_key, c.tc_partitions)}",
                           field="tc_partition")
        partition = await c.partition(k)
        topics, subscriptions, tp_errors, sp_errors = await c.targets(
            request.topic_partitions, request.subscription_partitions)
        result = await partition.call(lambda core, now: core.new_txn(
            now, request.timeout_ms, parent, session, request.idempotency_key, topics,
            subscriptions, stream))
        return coordinator_pb2.NewTxnResponse(
            txn_id=_txn_id_proto(result.txn_id), state=result.state.value,
            existing=result.existing, timeout_ms=result.timeout_ms,
            topic_partition_results=[
                coordinator_pb2.TxnPartitionResult(topic_partition=proto, error=_item_error(e))
                for proto, e in zip(request.topic_partitions,
                                    _merge(tp_errors, result.topic_partition_results))],
            subscription_partition_results=[
                coordinator_pb2.TxnSubscriptionResult(subscription_partition=proto,
                                                      error=_item_error(e))
                for proto, e in zip(request.subscription_partitions,
                                    _merge(sp_errors, result.subscription_partition_results))])

    async def AddPartitionToTxn(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        if not request.topic_partitions:
            raise _invalid("topic_partitions is empty", field="topic_partitions")
        partition = await c.partition(txn_id.tc_partition)
        topics, _, errors, _ = await c.targets(request.topic_partitions, [])
        session = c.session(request)
        result = await partition.call(
            lambda core, now: core.add_partitions(now, txn_id, topics, session))
        return coordinator_pb2.AddPartitionToTxnResponse(results=[
            coordinator_pb2.TxnPartitionResult(topic_partition=proto, error=_item_error(e))
            for proto, e in zip(request.topic_partitions,
                                _merge(errors, result.topic_partition_results))])

    async def AddSubscriptionToTxn(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        if not request.subscription_partitions:
            raise _invalid("subscription_partitions is empty", field="subscription_partitions")
        partition = await c.partition(txn_id.tc_partition)
        _, subscriptions, _, errors = await c.targets([], request.subscription_partitions)
        session = c.session(request)
        result = await partition.call(
            lambda core, now: core.add_subscriptions(now, txn_id, subscriptions, session))
        return coordinator_pb2.AddSubscriptionToTxnResponse(results=[
            coordinator_pb2.TxnSubscriptionResult(subscription_partition=proto,
                                                  error=_item_error(e))
            for proto, e in zip(request.subscription_partitions,
                                _merge(errors, result.subscription_partition_results))])

    async def PrepareTxn(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        partition = await c.partition(txn_id.tc_partition)
        session = c.session(request)
        result = await partition.call(lambda core, now: core.prepare(
            now, txn_id, request.prepared_timeout_ms, session))
        return coordinator_pb2.PrepareTxnResponse(state=result.state.value,
                                                  prepared_timeout_ms=result.prepared_timeout_ms)

    async def EndTxn(self, request, context):
        started = time.perf_counter()
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        if request.decision not in (Decision.COMMIT.value, Decision.ABORT.value):
            raise _invalid("decision must be COMMIT or ABORT", field="decision")
        decision = Decision(request.decision)
        if len(request.children_to_keep) > c.limits.max_children:
            raise _invalid(f"more than {c.limits.max_children} children_to_keep")
        keep = []
        for index, child in enumerate(request.children_to_keep):
            if child.sequence == 0 or child.tc_partition != txn_id.tc_partition:
                raise _invalid(f"children_to_keep[{index}] is not a transaction of TC "
                               f"partition {txn_id.tc_partition}", field="children_to_keep")
            keep.append(TxnId(child.tc_partition, child.sequence))
        stream = c.stream(request, txn_id.tc_partition)
        partition = await c.partition(txn_id.tc_partition)
        session = c.session(request)
        result = await partition.call(lambda core, now: core.end_txn(
            now, txn_id, decision, keep, session, stream))
        state = result.state
        if request.wait_for_markers and state in (State.COMMITTING, State.ABORTING):
            if await partition.wait_completed(txn_id, _remaining_s(context)):
                state = State.COMMITTED if decision is Decision.COMMIT else State.ABORTED
        metrics.COMMIT_LATENCY.labels(str(request.wait_for_markers).lower()).observe(
            time.perf_counter() - started)
        return coordinator_pb2.EndTxnResponse(
            state=state.value, already_ended=result.already_ended,
            kept_child_txn_ids=[_txn_id_proto(t) for t in result.kept_child_txn_ids],
            aborted_child_txn_ids=[_txn_id_proto(t) for t in result.aborted_child_txn_ids])

    async def CommitTxn(self, request, context):
        started = time.perf_counter()
        c = self.c
        if request.abort:
            k, key, _ = self._one_call_key(request)
            if request.batches or request.acks:
                raise _invalid("an abort carries no batches and no acks", field="abort")
            partition = await c.partition(k)
            state = await partition.call(lambda core, now: core.abort_one_call(now, key))
            metrics.ONE_CALL.labels("aborted_by_client").inc()
            return coordinator_pb2.CommitTxnResponse(state=state.value)
        c.commit_begins()
        handed_off = False  # to a shielded parallel commit, which ends it itself
        try:
            parallel = c.commit_in_parallel()
            checked = await self._checked(request)
            # The commit lane (a combined server) first, unless parallel commits are on:
            # it costs the least CPU, and its stages and decision share one process.
            lane = None if c.settings.parallel_commits == "on" else c.lane
            here = None if lane is None else lane.servicer_for(request)
            if here is not None:
                return await self._commit_in_lane(request, checked, here, started, context)
            begun = await self._begin_one_call(request, parallel, checked)
            if isinstance(begun, coordinator_pb2.CommitTxnResponse):
                return begun  # already ended
            if begun.start.parallel:
                metrics.PARALLEL_COMMITS.inc()
                # Shielded: a caller that goes away must not leave the transaction
                # undecided by this coordinator (it would wait for a resolution). It
                # stays in flight until it ends, cancelled caller or not.
                commit = asyncio.ensure_future(
                    self._commit_parallel(request, begun, started, context))
                handed_off = True
                commit.add_done_callback(lambda _: c.commit_ends())
                return await asyncio.shield(commit)
            return await self._stage_and_decide(request, begun, started, context)
        finally:
            if not handed_off:
                c.commit_ends()

    async def _stage_and_decide(self, request, begun: "_OneCallBegun", started: float,
                                context, staged=None, failure=None, stage: bool = True):
        """CommitTxn after its begin: staged through the staging channel (unless
        `stage` is False: `staged` and `failure` are its outcome already), decided, and
        answered."""
        txn_id = begun.start.txn_id
        try:
            if stage:
                try:
                    staged = await self.c.stager.stage(txn_id, begun.partition.epoch,
                                                       request.batches, request.acks,
                                                       begun.deadline(context))
                except AtomlogError as error:
                    failure = error
            await failpoints.hold(failpoints.ONE_CALL_DECIDE)
        except asyncio.CancelledError:
            # The caller went away before the decision: the transaction is aborted now
            # (presumed abort), not left staging, holding its key, its session and its
            # partitions' max read position until its timeout.
            self._abort_begun(begun)
            raise
        result = await begun.partition.call(
            lambda core, now: core.end_one_call(now, txn_id, failure))
        return await self._decided(request, begun, result, staged, started, context)

    def _abort_begun(self, begun: "_OneCallBegun") -> None:
        txn_id = begun.start.txn_id
        gone = AtomlogError("TRANSACTION_ABORTED", f"the CommitTxn of one-call transaction "
                            f"{txn_id} was cancelled before its decision")
        ending = asyncio.ensure_future(begun.partition.call(
            lambda core, now: core.end_one_call(now, txn_id, gone)))
        ending.add_done_callback(observe_failure)

    async def _commit_in_lane(self, request, checked, here, started: float, context):
        """CommitTxn through the commit lane (coordinator/lane.py): validated (`checked`),
        then begun, staged and decided there; what the lane hands back goes on from
        where it stopped, on the ordinary path."""
        k, key, session, tps, subs, partition = checked
        remaining = _remaining_s(context)
        outcome = await self.c.lane.commit(
            request, k, key, session, tps, subs, partition, here,
            None if remaining is None else time.monotonic() + remaining)
        begun = outcome.begun
        if outcome.result is not None:
            return await self._decided(request, begun, outcome.result, outcome.staged,
                                       started, context)
        if outcome.begin_futures:  # a sequence reservation, logged before staging
            await asyncio.wait(outcome.begin_futures)
            for future in outcome.begin_futures:
                future.result()
        if begun.start.existing is not None:
            return _already_ended(begun.start)
        return await self._stage_and_decide(request, begun, started, context,
                                            outcome.staged, outcome.failure,
                                            stage=outcome.staged is None)

    async def _commit_parallel(self, request, begun: "_OneCallBegun", started: float,
                               context):
        """A parallel commit (docs/coordinator.md): the stages and the Staging record go
        at once; once both are durable the transaction is committed, and end_one_call
        answers without waiting for Decided(COMMIT)."""
        c, partition, txn_id = self.c, begun.partition, begun.start.txn_id
        decided = False
        try:
            stage = asyncio.ensure_future(self._stage_parallel(request, begun, context))
            await asyncio.wait([stage, *begun.logged])
            failure, staged = None, None
            for future in begun.logged:
                error = future.exception()
                if error is not None:
                    if partition.phase is not Phase.ACTIVE:
                        raise error  # the TC partition moved: its next owner resolves it
                    failure = _as_atomlog_error(error)
            try:
                staged = stage.result()
            except AtomlogError as error:
                failure = failure or error
            await failpoints.hold(failpoints.ONE_CALL_DECIDE)
            result = await partition.call(
                lambda core, now: core.end_one_call(now, txn_id, failure))
            decided = True
        finally:
            if not decided and partition.phase is Phase.ACTIVE and partition.core is not None:
                partition.core.release_staging(txn_id)  # left to a resolution
        return await self._decided(request, begun, result, staged, started, context)

    async def _stage_parallel(self, request, begun: "_OneCallBegun", context):
        await failpoints.hold(failpoints.ONE_CALL_STAGE)
        return await self.c.stager.stage(begun.start.txn_id, begun.partition.epoch,
                                         request.batches, request.acks,
                                         begun.deadline(context))

    async def CommitTxns(self, request, context):
        """One-call transactions of one TC partition staged in order (coordinator.proto):
        each begins as CommitTxn does, all are staged in one chain
        (StageChannel.stage_chain), and their decisions go in one append
        (TcPartitionCore.end_one_calls): the first that does not commit, at staging or
        at its decision, aborts those after it."""
        started = time.perf_counter()
        commits = request.commits
        if not commits:
            raise _invalid("CommitTxns needs at least one commit", field="commits")
        if len(commits) > MAX_CHAINED_COMMITS:
            raise _invalid(f"at most {MAX_CHAINED_COMMITS} commits per call", field="commits",
                           limit=str(MAX_CHAINED_COMMITS))
        keys: dict[str, int] = {}
        for index, commit in enumerate(commits):
            if commit.abort:
                raise _invalid(f"commits[{index}]: CommitTxns takes no aborts (send "
                               "CommitTxn with abort)", field="commits")
            # (Else the first committed and the second, refused as concurrent, would be
            # answered already_ended with the first's id on its retry: its batches would
            # look committed and never were.)
            first = keys.setdefault(commit.idempotency_key, index)
            if first != index:
                raise _invalid(f"commits[{index}] has the idempotency key of "
                               f"commits[{first}]: each transaction needs its own",
                               field="commits")
            if commit.tc_partition != commits[0].tc_partition:
                raise _invalid(f"commits[{index}] names TC partition {commit.tc_partition}, "
                               f"commits[0] {commits[0].tc_partition}: one CommitTxns call "
                               "commits on one TC partition", field="commits")
        self.c.commit_begins(len(commits))  # load, for parallel_commits=auto
        try:
            return await self._commit_chain(commits, started, context)
        finally:
            self.c.commit_ends(len(commits))

    async def _commit_chain(self, commits, started: float, context):
        """CommitTxns once validated: begun, staged in one chain, decided in one append."""
        results: list = [None] * len(commits)
        begun: list[tuple[int, _OneCallBegun]] = []
        broken = None
        for index, commit in enumerate(commits):
            if broken is not None:
                results[index] = AtomlogError(
                    "EARLIER_COMMIT_FAILED", f"commits[{broken}] of this call was refused")
                continue
            try:
                outcome = await self._begin_one_call(commit)
            except Exception as error:  # noqa: BLE001 — this commit's answer; the chain breaks
                results[index], broken = _as_atomlog_error(error), index
                continue
            if isinstance(outcome, coordinator_pb2.CommitTxnResponse):
                results[index] = outcome  # already ended: nothing to stage
            else:
                begun.append((index, outcome))
        if begun:
            staged = await self.c.stager.stage_chain([StageOrder(
                b.start.txn_id, b.partition.epoch, commits[i].batches, commits[i].acks,
                b.deadline(context)) for i, b in begun])
            await failpoints.hold(failpoints.ONE_CALL_DECIDE)
            items = [(b.start.txn_id, outcome if isinstance(outcome, AtomlogError) else None)
                     for (_, b), outcome in zip(begun, staged)]
            partition = begun[0][1].partition
            try:
                decided = await partition.call(
                    lambda core, now: core.end_one_calls(now, items))
            except Exception as error:  # noqa: BLE001 — the append failed: none committed
                decided = [_as_atomlog_error(error)] * len(begun)
            answers = await asyncio.gather(*(
                self._decided(commits[i], b, result, outcome, started, context)
                for (i, b), result, outcome in zip(begun, decided, staged)),
                return_exceptions=True)
            for (index, _), answer in zip(begun, answers):
                results[index] = _as_atomlog_error(answer) if isinstance(
                    answer, BaseException) else answer
        response = coordinator_pb2.CommitTxnsResponse()
        for outcome in results:
            result = response.results.add()
            if isinstance(outcome, AtomlogError):
                result.error.reason = outcome.reason
                result.error.message = outcome.message
                result.error.metadata.update(outcome.metadata)
            else:
                result.response.CopyFrom(outcome)
        metrics.CHAINED_COMMITS.observe(len(commits))
        return response

    def _one_call_key(self, request):
        """The TC partition, idempotency key and session of a CommitTxn, checked."""
        c = self.c
        k = c.check_tc(request.tc_partition)
        session = c.session(request)
        key = request.idempotency_key
        if not key:
            raise _invalid("idempotency_key is required (it makes the call retry-safe)",
                           field="idempotency_key")
        routed_by = session.transactional_id if session is not None and \
            session.transactional_id else key
        if tc_partition_for(routed_by, c.tc_partitions) != k:
            raise _invalid(f"{'transactional id' if routed_by != key else 'idempotency key'} "
                           f"{routed_by!r} lives on TC partition "
                           f"{tc_partition_for(routed_by, c.tc_partitions)}",
                           field="tc_partition")
        return k, key, session

    async def _checked(self, request):
        """A CommitTxn validated and routed: (TC partition, key, session, its partitions,
        its subscription partitions, the TcPartition). Unknown topics are looked up
        (`_one_call_targets`), so the routes know them after this."""
        k, key, session = self._one_call_key(request)
        tps, subs = await self._one_call_targets(request)
        return k, key, session, tps, subs, await self.c.partition(k)

    async def _begin_one_call(self, request, parallel: bool = False, checked=None):
        """CommitTxn up to staging: validated (unless `checked` by `_checked` already), a
        transaction id from the TC partition. Returns _OneCallBegun, or the answer of an
        already committed key. `parallel`: a parallel commit, whose Staging append is not
        waited for here (_OneCallBegun.logged)."""
        k, key, session, tps, subs, partition = checked or await self._checked(request)
        logged: list = []
        if parallel:
            start, logged = partition.call_parallel(lambda core, now: core.begin_one_call(
                now, request.timeout_ms, session, key, tps, subs, parallel=True))
            if not start.parallel and logged:  # a reservation first: two rounds this time
                await asyncio.wait(logged)
                for future in logged:
                    future.result()
                logged = []
        else:
            start = await partition.call(lambda core, now: core.begin_one_call(
                now, request.timeout_ms, session, key, tps, subs))
        if start.existing is not None:
            return _already_ended(start)
        return _OneCallBegun(k, partition, start, time.monotonic() + start.timeout_ms / 1000,
                             logged)

    async def _decided(self, request, begun: "_OneCallBegun", result, staged,
                       started: float, context):
        """CommitTxn's answer from its decision (end_one_call's reply): raises the refusal
        of one that did not commit (or an error given instead); with wait_for_markers,
        waits for the markers."""
        if isinstance(result, BaseException):
            raise result
        partition, txn_id = begun.partition, begun.start.txn_id
        if isinstance(result, OneCallAborted):
            metrics.ONE_CALL.labels(result.error.reason).inc()
            if result.error.reason == "STALE_COORDINATOR_EPOCH":
                # A partition server knows a newer owner of this TC partition: the client
                # retries there (the key is free: nothing was decided here).
                raise AtomlogError("NOT_COORDINATOR", f"TC partition {begun.k} has a newer "
                                   f"owner than {self.c.name}: {result.error.message}",
                                   {"tc_partition": str(begun.k)})
            raise result.error
        metrics.ONE_CALL.labels("committed").inc()
        state = result.state
        if request.wait_for_markers and state is State.COMMITTING:
            if await partition.wait_completed(txn_id, _remaining_s(context)):
                state = State.COMMITTED
        metrics.ONE_CALL_LATENCY.labels(str(request.wait_for_markers).lower()).observe(
            time.perf_counter() - started)
        return coordinator_pb2.CommitTxnResponse(txn_id=_txn_id_proto(txn_id),
                                                 state=state._value_, batch_results=staged)

    async def _one_call_targets(self, request):
        """The partitions and subscription partitions of a CommitTxn, validated: every
        batch well formed and stageable (the partition server checks its CRC), at most one
        per partition and one ack per subscription partition, within the size bound."""
        c = self.c
        if not request.batches and not request.acks:
            raise _invalid("a one-call transaction needs batches or acks", field="batches")
        if len(request.batches) + len(request.acks) > MAX_ITEMS:
            raise _invalid(f"at most {MAX_ITEMS} batches and acks per call")
        size = 0
        for index, item in enumerate(request.batches):
            batch = item.record_batch
            size += len(batch)
            try:
                header = parse_header(batch)
                if header.batch_length + LENGTH_FIELD_END != len(batch):
                    raise AtomlogError("CORRUPT_BATCH", f"batch_length says "
                                       f"{header.batch_length + LENGTH_FIELD_END} bytes, the "
                                       f"batch has {len(batch)}")
                check_stageable(header)
            except AtomlogError as error:
                raise AtomlogError(error.reason, f"batches[{index}]: {error.message}",
                                   {**error.metadata, "field": "batches"}) from None
        for index, ack in enumerate(request.acks):
            size += ack.ByteSize()
            if not ack.subscription_partition.subscription:
                raise _invalid(f"acks[{index}]: the subscription is empty", field="acks")
            if ack.cumulative_end_offset <= 0 and not ack.individual_ranges:
                raise _invalid(f"acks[{index}] acknowledges nothing", field="acks")
        if size > c.one_call_max_bytes:
            raise _invalid(f"the transaction carries {size} bytes; one-call transactions "
                           f"hold at most {c.one_call_max_bytes} (coordinator."
                           "one_call_max_bytes): use NewTxn, Produce and EndTxn",
                           field="batches", limit="coordinator.one_call_max_bytes")
        topics, subscriptions, tp_errors, sp_errors = await c.targets(
            [item.topic_partition for item in request.batches],
            [ack.subscription_partition for ack in request.acks])
        for error in (*tp_errors, *sp_errors):
            if error is not None:
                raise error
        if len(set(topics)) != len(topics) or len(set(subscriptions)) != len(subscriptions):
            raise _invalid("at most one batch per partition and one ack per subscription "
                           "partition", field="batches")
        return topics, subscriptions

    async def GetTxnStatus(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        partition = await c.partition(txn_id.tc_partition)
        status = partition.query(lambda core, now: core.status(txn_id, now))
        return coordinator_pb2.GetTxnStatusResponse(
            state=status.state.value, end_cause=status.end_cause.value,
            parent_txn_id=_txn_id_proto(status.parent), remaining_ms=status.remaining_ms)

    async def InitProducerId(self, request, context):
        c = self.c
        if request.producer_id < 0:
            raise _invalid(f"producer_id {request.producer_id} is negative", field="producer_id")
        if not request.transactional_id:
            # An idempotent producer (re)starting gets a fresh id: sequences begin at 0.
            return coordinator_pb2.InitProducerIdResponse(
                producer_id=await c.producer_ids.next_id(), producer_epoch=0)
        try:
            k = tc_partition_for(request.transactional_id, c.tc_partitions)
        except UnicodeEncodeError:
            raise _invalid("transactional_id is not valid UTF-8") from None
        partition = await c.partition(k)

        def init(fresh: int | None):
            return lambda core, now: core.init_producer_id(
                now, request.transactional_id, request.transaction_timeout_ms,
                request.producer_id, request.producer_epoch, fresh)
        try:
            result = await partition.call(init(None))
        except ProducerIdNeeded:
            result = await partition.call(init(await c.producer_ids.next_id()))
        return coordinator_pb2.InitProducerIdResponse(
            producer_id=result.producer_id, producer_epoch=result.producer_epoch,
            tc_partition=k, aborted_txn_id=_txn_id_proto(result.aborted_txn_id),
            transaction_timeout_ms=result.transaction_timeout_ms)

    async def VerifyTxnPartitions(self, request, context):
        c = self.c
        if not request.items:
            raise _invalid("items is empty", field="items")
        if len(request.items) > MAX_ITEMS:
            raise _invalid(f"at most {MAX_ITEMS} items per call", field="items")
        results = []
        for item in request.items:
            result = coordinator_pb2.VerifyTxnPartitionsResult(txn_id=item.txn_id)
            try:
                txn_id = c.txn_id(item, "txn_id")
                kind = item.WhichOneof("target")
                if kind is None:
                    raise _invalid("the item has no target", field="target")
                proto = getattr(item, kind)
                try:
                    target = (TopicPartition(proto.topic, proto.partition)
                              if kind == "topic_partition" else
                              SubscriptionPartition(proto.topic, proto.partition,
                                                    proto.subscription))
                except ValueError as error:
                    raise _invalid(str(error), field=kind) from None
                partition = await c.partition(txn_id.tc_partition)
                answer = partition.require_active().verify(txn_id, target)
                result.state = answer.state.value
                result.included = answer.included
                result.coordinator_epoch = answer.coordinator_epoch
                if self.authorizer is not None:
                    result.opener = self.authorizer.opener(txn_id.tc_partition, txn_id.sequence)
                if answer.session is not None:
                    result.session.CopyFrom(_session_proto(answer.session))
            except AtomlogError as error:
                result.error.CopyFrom(_item_error(error))
            results.append(result)
        return coordinator_pb2.VerifyTxnPartitionsResponse(results=results)

    async def ListTransactions(self, request, context):
        c = self.c
        states = []
        for value in request.states:
            try:
                states.append(State(value))
            except ValueError:
                raise _invalid(f"unknown state {value}", field="states") from None
        if request.min_age_ms < 0:
            raise _invalid("min_age_ms is negative", field="min_age_ms")
        wanted = ([c.check_tc(k, "tc_partitions") for k in request.tc_partitions]
                  or list(range(c.tc_partitions)))
        limit = min(request.limit or c.limits.default_list_limit, c.limits.max_list_limit)
        searched, not_owned, found, truncated = [], [], [], False
        for k in sorted(set(wanted)):
            partition = c.partitions.get(k)
            core = partition.core if partition is not None else None
            if core is None or partition.phase is not Phase.ACTIVE:
                if request.tc_partitions:
                    not_owned.append(k)
                continue
            answer = core.list_transactions(int(time.time() * 1000), states,
                                            request.min_age_ms, limit)
            searched.append(k)
            found.extend(answer.transactions)
            truncated |= answer.truncated
        found.sort(key=lambda s: (s.start_ms, s.txn_id))
        truncated |= len(found) > limit
        return coordinator_pb2.ListTransactionsResponse(
            transactions=[_summary_proto(s) for s in found[:limit]], tc_partitions=searched,
            not_owned_tc_partitions=not_owned, truncated=truncated)

    async def DescribeTransaction(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        partition = await c.partition(txn_id.tc_partition)
        d = partition.query(lambda core, now: core.describe(txn_id, now))
        return coordinator_pb2.DescribeTransactionResponse(
            summary=_summary_proto(d.summary),
            topic_partitions=[_tp_proto(t) for t in d.topic_partitions],
            subscription_partitions=[_sp_proto(s) for s in d.subscription_partitions],
            children=[_summary_proto(s) for s in d.children],
            marker_pending_topic_partitions=[_tp_proto(t)
                                             for t in d.marker_pending_topic_partitions],
            marker_pending_subscription_partitions=[
                _sp_proto(s) for s in d.marker_pending_subscription_partitions],
            marker_retry_count=d.marker_retry_count, prepared_timeout_ms=d.prepared_timeout_ms,
            prepared_unix_ms=d.prepared_ms, decided_unix_ms=d.decided_ms,
            completed_unix_ms=d.completed_ms, idempotency_key=d.idempotency_key,
            coordinator_epoch=d.coordinator_epoch)

    async def AbortTransaction(self, request, context):
        c = self.c
        txn_id = c.txn_id(request, "txn_id")
        if len(request.reason.encode()) > 1024:
            raise _invalid("reason is longer than 1024 bytes", field="reason")
        partition = await c.partition(txn_id.tc_partition)
        result = await partition.call(
            lambda core, now: core.abort(now, txn_id, request.allow_prepared))
        event(log, "operator abort", txn_id=str(txn_id), reason=request.reason,
              already_ended=result.already_ended)
        return coordinator_pb2.AbortTransactionResponse(
            state=result.state.value, already_ended=result.already_ended,
            aborted_child_txn_ids=[_txn_id_proto(t) for t in result.aborted_child_txn_ids])


async def ensure_txn_log_topic(metadata_store, tc_partitions: int, segment_bytes: int,
                               expected_servers: int = 0, expected_wait_s: float = 60.0) -> None:
    """Create `__txn_log` (one partition per TC partition) if missing; wait for partition
    servers when there are none yet, and for `expected_servers` of them (at most
    `expected_wait_s` after the first registered) so that its partitions and replicas
    spread over every server of a cluster that is still starting."""
    attempt = 0
    first_seen: float | None = None  # when a partition server was first registered
    while True:
        try:
            existing = await metadata_store.topics([TXN_LOG_TOPIC])
            if existing[0].partitions != tc_partitions:
                raise AtomlogError("INTERNAL", f"{TXN_LOG_TOPIC} has {existing[0].partitions} "
                                   f"partitions, the cluster {tc_partitions} TC partitions")
            return
        except AtomlogError as error:
            if error.reason != "UNKNOWN_TOPIC_OR_PARTITION":
                raise
        registered = sum(1 for s in await metadata_store.servers()
                         if s.role == "partition_server")
        if registered and first_seen is None:
            first_seen = time.monotonic()
        waited = time.monotonic() - first_seen if first_seen is not None else 0.0
        # (Not created below the count even with none registered: create_topic lists the
        # servers again, and one registering meanwhile would get every partition.)
        if registered < expected_servers and waited < expected_wait_s:
            attempt += 1
            if attempt == 1 or attempt % 50 == 0:
                event(log, f"waiting for partition servers to create {TXN_LOG_TOPIC}",
                      registered=registered, expected=expected_servers,
                      wait_left_seconds=round(expected_wait_s - waited, 1))
            await asyncio.sleep(0.2)
            continue
        if registered and registered < expected_servers:
            event(log, f"creating {TXN_LOG_TOPIC} on fewer partition servers than expected",
                  logging.WARNING, registered=registered, expected=expected_servers,
                  hint="its partitions stay where they are created; replicated ones can "
                  "move with `atomlog partition reassign`")
        try:
            await metadata_store.create_topic(
                TXN_LOG_TOPIC, tc_partitions,
                {"segment.bytes": str(segment_bytes), "retention.ms": "-1",
                 "retention.bytes": "-1"}, internal=True)
            return
        except AtomlogError as error:
            if error.reason == "TOPIC_ALREADY_EXISTS":
                continue
            if error.reason != "NO_PARTITION_SERVERS":
                raise
        attempt += 1
        if attempt == 1 or attempt % 50 == 0:
            event(log, f"waiting for partition servers to create {TXN_LOG_TOPIC}")
        await asyncio.sleep(0.2)


async def install(runtime) -> list[str]:
    config = runtime.config
    limits = Limits(**{name: config[f"transaction.{name}"]
                       for name in Limits.__dataclass_fields__})
    settings = Settings(**{f.name: config[f"coordinator.{f.name}"]
                           for f in fields(Settings)})
    tc_partitions = runtime.tc_partitions
    producer_ids = ProducerIds(runtime.metadata, requester=runtime.name)
    routes = PartitionRoutes(runtime.metadata, config["coordinator.partition_link"])
    markers = MarkerChannel(routes, config["coordinator.marker_batch_max"],
                            config["coordinator.log_request_timeout_ms"] / 1000,
                            config["coordinator.marker_linger_ms"] / 1000)
    stager = StageChannel(routes, config["coordinator.stage_batch_max"],
                          config["coordinator.log_request_timeout_ms"] / 1000, markers,
                          config["coordinator.stage_settle_turns"])
    coordinator = Coordinator(runtime.name, tc_partitions, routes, markers, producer_ids,
                              limits, settings, runtime.metadata, stager,
                              config["coordinator.one_call_max_bytes"])
    collector = metrics.register_core_collector(
        coordinator.cores, lambda: coordinator.one_calls_in_flight)
    runtime.coordinator = coordinator
    servicer = CoordinatorServicer(coordinator, runtime.interceptor.authorizer)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, runtime.server)
    runtime.local_services[service_name(coordinator_pb2, "CoordinatorService")] = servicer
    if config["coordinator.client_link"]:
        # Clients' transaction calls (docs/clients.md, "The link"); a combined server's
        # partition server opened the link already, and this joins it.
        runtime.registration_extra["coordinator"] = {"link": await serve_on_link(
            runtime, "CoordinatorService", servicer, "coordinator.link_listen",
            "coordinator.link_advertised_port")}

    start_task: asyncio.Task | None = None

    async def take_leases() -> None:
        attempt = 0
        while True:
            try:
                await ensure_txn_log_topic(
                    runtime.metadata, tc_partitions, config["coordinator.log_segment_bytes"],
                    config["coordinator.expected_partition_servers"],
                    config["coordinator.expected_servers_wait_ms"] / 1000)
                await routes.refresh(force=True)
                break
            except Exception:
                attempt += 1
                log.exception("cannot prepare %s (attempt %d)", TXN_LOG_TOPIC, attempt)
                await asyncio.sleep(min(5.0, 0.2 * attempt))
        coordinator.leases = LeaseManager(
            runtime.zk, runtime.name, tc_partitions, on_acquired=coordinator.on_acquired,
            on_lost=coordinator.on_lost, new_log_producer_id=producer_ids.next_id,
            rebalance_interval_ms=config["coordinator.rebalance_interval_ms"])
        await coordinator.leases.start()

    def taken(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Not expected (take_leases retries what can fail), but a coordinator that
            # will never own a TC partition must say so, not serve NOT_COORDINATOR quietly.
            log.error("the coordinator stopped trying to take TC leases",
                      exc_info=task.exception())

    async def start() -> None:
        nonlocal start_task
        start_task = asyncio.create_task(take_leases(), name="take-leases")
        start_task.add_done_callback(taken)

    async def stop() -> None:
        if start_task is not None and not start_task.done():
            start_task.cancel()
            await asyncio.gather(start_task, return_exceptions=True)
        if coordinator.leases is not None:
            await coordinator.leases.stop()
        for k in list(coordinator.partitions):
            await coordinator.on_lost(k)
        await markers.close()
        await stager.close()
        await coordinator.log_channel.close()
        await routes.close()
        await producer_ids.close()
        from prometheus_client import REGISTRY
        REGISTRY.unregister(collector)

    runtime.start_hooks.append(start)
    runtime.stop_hooks.append(stop)
    return [service_name(coordinator_pb2, "CoordinatorService")]
