"""The marker channel: EndTxnOnPartition calls from a coordinator to partition servers.

Markers of every TC partition of the process are queued per destination server and sent
by one task per server, as few calls as possible (everything queued, up to the batch
limit, goes in one call; markers of one transaction share one TxnMarker). A confirmation
goes back to the TC partition that sent the marker. Failures need no bookkeeping here:
the TC partition's tick re-sends every unconfirmed marker (`transaction.marker_retry_ms`).
A "STALE_COORDINATOR_EPOCH" answer means the sender's lease is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Protocol

import grpc
from atomlog.v1 import common_pb2, partition_pb2

from coordinator import metrics
from coordinator.core import Marker
from coordinator.records import SubscriptionPartition, TopicPartition, TxnId
from coordinator.routing import PartitionRoutes
from services import failpoints
from services.errors import from_rpc_error
from services.logs import event

log = logging.getLogger("atomlog.coordinator.markers")

ROUTING_REASONS = frozenset({"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                             "SERVER_UNAVAILABLE"})


class MarkerSink(Protocol):
    def marker_confirmed(self, txn_id: TxnId, target: TopicPartition | SubscriptionPartition,
                         epoch: int) -> None: ...

    def marker_epoch_stale(self, epoch: int) -> None: ...


class MarkerChannel:
    def __init__(self, routes: PartitionRoutes, batch_max: int = 10_000,
                 request_timeout_s: float = 5.0):
        self.routes = routes
        self.batch_max = batch_max
        self.request_timeout_s = request_timeout_s
        self._queues: dict[str, list[tuple[MarkerSink, Marker]]] = defaultdict(list)
        self._wakeups: dict[str, asyncio.Event] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self._refresh: asyncio.Task | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def send(self, sink: MarkerSink, markers) -> None:
        """Queue markers (never blocks). A marker whose owner is unknown is dropped for
        now (its TC partition re-sends it) and the routes are refreshed."""
        unroutable = False
        for marker in markers:
            address = self.routes.cached_owner(marker.target.topic, marker.target.partition)
            if not address:
                unroutable = True
                continue
            self._queues[address].append((sink, marker))
            self._wake(address)
        if unroutable:
            self._refresh_soon()
        metrics.MARKER_QUEUE.set(self.queued)

    def _wake(self, address: str) -> None:
        if self._closed:
            return
        wakeup = self._wakeups.get(address)
        if wakeup is None:
            wakeup = self._wakeups[address] = asyncio.Event()
            self._senders[address] = asyncio.create_task(self._sender(address),
                                                          name=f"markers->{address}")
        wakeup.set()

    def _refresh_soon(self) -> None:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self.routes.refresh(force=True))

    async def _sender(self, address: str) -> None:
        wakeup = self._wakeups[address]
        while not self._closed:
            await wakeup.wait()
            wakeup.clear()
            while self._queues[address]:
                queue = self._queues[address]
                batch, self._queues[address] = queue[:self.batch_max], queue[self.batch_max:]
                metrics.MARKER_QUEUE.set(self.queued)
                try:
                    await self._deliver(address, batch)
                except Exception:
                    log.exception("marker delivery to %s failed", address)

    async def _deliver(self, address: str, batch: list[tuple[MarkerSink, Marker]]) -> None:
        # One TxnMarker per (sender, transaction, decision, epoch), targets in order.
        grouped: dict[tuple, list[Marker]] = {}
        for sink, marker in batch:
            key = (id(sink), marker.txn_id, marker.decision, marker.coordinator_epoch)
            grouped.setdefault(key, []).append(marker)
        sinks = {id(sink): sink for sink, _ in batch}
        keys = list(grouped)
        request = partition_pb2.EndTxnOnPartitionRequest(markers=[
            _to_proto(grouped[key]) for key in keys])
        await failpoints.hold(failpoints.MARKERS_SEND)
        metrics.MARKER_CALLS.inc()
        try:
            response = await self.routes.stub(address).EndTxnOnPartition(
                request, timeout=self.request_timeout_s)
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            metrics.MARKER_FAILURES.labels(failure.reason).inc(len(batch))
            if failure.reason in ROUTING_REASONS or failure.reason == "REQUEST_TIMED_OUT":
                self._refresh_soon()
            return
        refresh = False
        for key, result in zip(keys, response.results):
            sink = sinks[key[0]]
            markers = grouped[key]
            targets = ([TopicPartition(p.topic_partition.topic, p.topic_partition.partition)
                        for p in result.topic_partition_results]
                       + [SubscriptionPartition(s.subscription_partition.topic,
                                                s.subscription_partition.partition,
                                                s.subscription_partition.subscription)
                          for s in result.subscription_partition_results])
            errors = ([p.error.reason for p in result.topic_partition_results]
                      + [s.error.reason for s in result.subscription_partition_results])
            epoch = markers[0].coordinator_epoch
            for target, reason in zip(targets, errors):
                if not reason:
                    metrics.MARKERS_CONFIRMED.inc()
                    sink.marker_confirmed(markers[0].txn_id, target, epoch)
                elif reason == "STALE_COORDINATOR_EPOCH":
                    metrics.MARKER_FAILURES.labels(reason).inc()
                    sink.marker_epoch_stale(epoch)
                    break
                else:
                    metrics.MARKER_FAILURES.labels(reason).inc()
                    refresh |= reason in ROUTING_REASONS
        if refresh:
            self._refresh_soon()

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._senders.values())
        if self._refresh is not None:
            tasks.append(self._refresh)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        event(log, "marker channel closed", servers=len(self._senders))


def _to_proto(markers: list[Marker]) -> partition_pb2.TxnMarker:
    first = markers[0]
    return partition_pb2.TxnMarker(
        txn_id=common_pb2.TxnId(tc_partition=first.txn_id.tc_partition,
                                sequence=first.txn_id.sequence),
        decision=first.decision.value, coordinator_epoch=first.coordinator_epoch,
        topic_partitions=[common_pb2.TopicPartition(topic=m.target.topic,
                                                    partition=m.target.partition)
                          for m in markers if isinstance(m.target, TopicPartition)],
        subscription_partitions=[common_pb2.SubscriptionPartition(
            topic=m.target.topic, partition=m.target.partition,
            subscription=m.target.subscription)
            for m in markers if isinstance(m.target, SubscriptionPartition)])
