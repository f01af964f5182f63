"""Verification of transactional writes with their coordinator (no hanging transactions).

Before the first write of a transaction to a partition, the partition server asks the
transaction's coordinator whether it is OPEN and includes the partition
(VerifyTxnPartitions). Questions for the same coordinator are coalesced: one task per
coordinator address sends everything queued in one call, so a burst of first writes
costs one round trip. Routing: TC partition k's owner is read from ZooKeeper
(/tc/<k>/owner → the coordinator's registration), cached, and refreshed on
NOT_COORDINATOR, COORDINATOR_LOADING or an unreachable server; those are retried with a
backoff until `timeout_s`, then the write is refused with a retriable reason (the
client's producer retries). Where the coordinator has a link (coordinator.client_link)
and this server uses links (replication.link), the call goes on it (copy_link.CallLink:
a fraction of a gRPC call's CPU on both sides; gRPC while it cannot be reached).

An answer counts only if its coordinator epoch is not below the epoch this server knows
for TC partition k (CoordinatorEpochs): a deposed coordinator's "OPEN" is not trusted.
The answer cache and the race with markers are the partition's business
(partition_server/txn_guard.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from atomlog.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from coordinator.routing import CHANNEL_OPTIONS
from partition_server.coordinator_epochs import CoordinatorEpochs
from partition_server.copy_link import CallLinks
from partition_server.record_batch import TxnId
from services import failpoints, local
from services.backoff import Backoff
from services.batching import PerDestination
from services.errors import AtomlogError, from_rpc_error
from services.fastmetrics import Counter, Histogram
from services.metrics import LATENCY_BUCKETS_SECONDS

COORDINATOR_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name

log = logging.getLogger("atomlog.partition.verifier")

VERIFY_SECONDS = Histogram("atomlog_partition_txn_verification_duration_seconds",
                           "Time to verify a transaction's first write to a partition with "
                           "its coordinator (queueing and retries included).",
                           buckets=LATENCY_BUCKETS_SECONDS)
VERIFICATIONS = Counter("atomlog_partition_txn_verifications_total",
                        "Verifications with coordinators, by result (ok, or the reason the "
                        "write was refused).", ["result"])
VERIFY_CALLS = Counter("atomlog_partition_txn_verify_calls_total",
                       "VerifyTxnPartitions calls sent (each carries many questions).")

RETRY_REASONS = frozenset({"NOT_COORDINATOR", "COORDINATOR_LOADING", "SERVER_UNAVAILABLE",
                           "REQUEST_TIMED_OUT", "SHUTTING_DOWN", "ZOOKEEPER_UNAVAILABLE"})
OPEN = coordinator_pb2.TXN_STATE_OPEN
_STATE_NAMES = {value: name.removeprefix("TXN_STATE_")
                for name, value in coordinator_pb2.TxnState.items()}
_ENDED_REASONS = {coordinator_pb2.TXN_STATE_ABORTING: "TRANSACTION_ABORTED",
                  coordinator_pb2.TXN_STATE_ABORTED: "TRANSACTION_ABORTED"}


@dataclass(frozen=True, slots=True)
class Answer:
    """A positive verification: the session the batches must carry (or None), and the
    principal that opened the transaction ("": not known, or authorization off)."""

    session: tuple[int, int] | None
    opener: str = ""


@dataclass(eq=False)
class _Question:
    txn: TxnId
    topic: str
    partition: int
    subscription: str | None = None
    raw: bool = False  # answer (state, coordinator epoch) instead of judging a write


class TxnVerifier:
    def __init__(self, metadata_store, epochs: CoordinatorEpochs, *, timeout_s: float = 10.0,
                 batch_max: int = 1_000, request_timeout_s: float = 5.0,
                 use_links: bool = True):
        self.store = metadata_store
        self.epochs = epochs
        self.timeout_s = timeout_s
        self.batch_max = batch_max
        self.request_timeout_s = request_timeout_s
        self._routes: dict[int, str] = {}  # TC partition -> coordinator address
        self.use_links = use_links
        self._link_addresses: dict[str, str] = {}  # coordinator address -> its link
        # An unreachable link: its coordinator may have restarted with another one.
        self._links = CallLinks("CoordinatorService", lambda: self._routes.clear())
        self._routes_lock = asyncio.Lock()
        self._calls = PerDestination(self._send, what="verification", max_items=batch_max)
        self._stubs = local.StubCache(COORDINATOR_SERVICE,
                                      coordinator_pb2_grpc.CoordinatorServiceStub, CHANNEL_OPTIONS)

    async def state(self, txn: TxnId, topic: str, partition: int, *,
                    subscription: str | None = None) -> tuple[int, int]:
        """(TxnState value, coordinator epoch) of the transaction as its coordinator
        sees it now (presumed abort: ABORTED for one it never committed), or
        AtomlogError. The epoch is not below the one this server knows."""
        return await self.verify(txn, topic, partition, subscription=subscription, raw=True)

    async def verify(self, txn: TxnId, topic: str, partition: int, *,
                     subscription: str | None = None,
                     raw: bool = False) -> Answer | tuple[int, int]:
        """OPEN and includes topic-partition (or that subscription of it, for a
        transactional ack), or AtomlogError saying why not. With `raw`: what state()
        answers instead."""
        began = time.perf_counter()
        backoff = Backoff(initial_s=0.02, maximum_s=0.5)
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        try:
            while True:
                attempt += 1
                try:
                    address = await self._route(txn.tc_partition, refresh=attempt > 1)
                    question = _Question(txn, topic, partition, subscription, raw)
                    answer = self._judge(question, await self._calls.submit(address, question))
                    VERIFICATIONS.labels("ok").inc()
                    return answer
                except AtomlogError as error:
                    if error.reason not in RETRY_REASONS:
                        VERIFICATIONS.labels(error.reason).inc()
                        raise
                    delay = backoff.delay(attempt)
                    if time.monotonic() + delay >= deadline:
                        VERIFICATIONS.labels(error.reason).inc()
                        raise AtomlogError(
                            error.reason, f"cannot verify transaction {_name(txn)} with its "
                            f"coordinator within {self.timeout_s} s: {error.message}",
                            {"retry_after_ms": "200", **error.metadata}) from None
                    await asyncio.sleep(delay)
        finally:
            VERIFY_SECONDS.observe(time.perf_counter() - began)

    # ------------------------------------------------------------------ routing
    async def _route(self, k: int, refresh: bool) -> str:
        address = None if refresh else self._routes.get(k)
        if address:
            return address
        async with self._routes_lock:
            if not refresh and self._routes.get(k):
                return self._routes[k]
            leases = await self.store.tc_leases()
            entries = await self.store.servers()
            servers = {s.name: s.grpc_address for s in entries}
            self._link_addresses = {s.grpc_address: s.link for s in entries
                                    if s.role == "coordinator" and s.link}
            self._routes = {tc: servers.get(lease["coordinator_name"], "")
                            for tc, lease in leases.items()}
            # Channels and links to coordinators that are gone (a restarted pod has a
            # new address) are closed, not kept for good.
            current = {s.grpc_address for s in entries}
            self._stubs.retain(current)
            self._links.retain(current)
        address = self._routes.get(k)
        if not address:
            raise AtomlogError("NOT_COORDINATOR", f"TC partition {k} has no live owner now",
                               {"tc_partition": k})
        return address

    # ------------------------------------------------------------------ batching
    async def _send(self, address: str, group: list[_Question]) -> list:
        """One VerifyTxnPartitions call for the questions queued for `address`."""
        await failpoints.hold(failpoints.VERIFY_HOLD)
        request = coordinator_pb2.VerifyTxnPartitionsRequest(items=[_item(q) for q in group])
        VERIFY_CALLS.inc()
        try:
            reply = await self._stub(address).VerifyTxnPartitions(
                request, timeout=self.request_timeout_s)
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error) from None
        return list(reply.results)

    def _judge(self, question: _Question, result) -> Answer:
        txn = question.txn
        if result.error.reason:
            raise AtomlogError(result.error.reason, result.error.message,
                               dict(result.error.metadata))
        current = self.epochs.current(txn.tc_partition)
        if result.coordinator_epoch < current:
            raise AtomlogError("NOT_COORDINATOR", f"the answer about {_name(txn)} came from "
                               f"coordinator epoch {result.coordinator_epoch}; the current one "
                               f"is {current}", {"tc_partition": txn.tc_partition})
        self.epochs.observe(txn.tc_partition, result.coordinator_epoch)
        if question.raw:
            return result.state, result.coordinator_epoch
        target = f"{question.topic}-{question.partition}" + (
            f" (subscription {question.subscription})" if question.subscription else "")
        if result.state != OPEN:
            state = _STATE_NAMES.get(result.state, str(result.state))
            raise AtomlogError(_ENDED_REASONS.get(result.state, "TRANSACTION_NOT_OPEN"),
                               f"transaction {_name(txn)} is {state}; it takes no more writes "
                               f"(to {target})", {"txn_id": _name(txn), "state": state})
        if not result.included:
            raise AtomlogError("PARTITION_NOT_IN_TRANSACTION",
                               f"{target} was not added to transaction {_name(txn)} "
                               "(AddPartitionToTxn) before this write",
                               {"txn_id": _name(txn), "topic": question.topic,
                                "partition": str(question.partition)})
        session = None
        if result.HasField("session") and result.session.producer_id:
            session = (result.session.producer_id, result.session.producer_epoch)
        return Answer(session, result.opener)

    def _stub(self, address: str) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        """In-process where this process is the coordinator; on the coordinator's link
        where it has one; else gRPC."""
        stub = self._stubs.get(address)
        if not self.use_links:
            return stub
        return self._links.stub(address, self._link_addresses.get(address, ""), stub)

    async def close(self) -> None:
        await self._calls.close()
        self._links.close()
        await self._stubs.close()


def _item(q: _Question) -> coordinator_pb2.VerifyTxnPartitionsItem:
    txn_id = common_pb2.TxnId(tc_partition=q.txn.tc_partition, sequence=q.txn.sequence)
    if q.subscription is not None:
        return coordinator_pb2.VerifyTxnPartitionsItem(
            txn_id=txn_id, subscription_partition=common_pb2.SubscriptionPartition(
                topic=q.topic, partition=q.partition, subscription=q.subscription))
    return coordinator_pb2.VerifyTxnPartitionsItem(
        txn_id=txn_id, topic_partition=common_pb2.TopicPartition(topic=q.topic,
                                                                 partition=q.partition))


def _name(txn: TxnId) -> str:
    return f"{txn.tc_partition}:{txn.sequence}"
