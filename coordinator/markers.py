"""The marker channel: EndTxnOnPartition calls from a coordinator to partition servers.

Markers of every TC partition of the process are queued per destination server and sent
by one task per server, as few calls as possible (everything queued, up to the batch
limit, goes in one call; markers of one transaction share one TxnMarker). A confirmation
goes back to the TC partition that sent the marker. Failures need no bookkeeping here:
the TC partition's tick re-sends every unconfirmed marker (`transaction.marker_retry_ms`).
A "STALE_COORDINATOR_EPOCH" answer means the sender's lease is gone.

Markers ride with staged data. A marker of a one-call transaction (nothing writes to it
after its decision, so holding its marker back lets no late write in; a streaming
transaction's markers are what stop a fenced zombie's writes, so they never wait) waits up
to `linger_s` for the next StageTxn call to its partition server and goes INSIDE that
call (StageTxnRequest.markers; `take_riders`, coordinator/staging.py). The server applies
the markers and the staged data in the same event-loop turn, so both reach the
partition's owner before it next writes: the marker of one transaction and the staged
data of the next are one write group and ONE fsync, and one call instead of two. To a
partition server in another process every lingering marker rides with the next staging
call, whatever partitions it writes (a call saved costs more than a write group); to one
in this process (the combined server), where the call is a function call, only those for
partitions the call writes. At most `batch_max` ride in one call. A client that commits
transaction after transaction on the same partitions (a producer keyed to its
partitions, a consume-transform-produce worker) pays one fsync and one server-to-server
call per partition server per transaction instead of two. Nothing waits on these markers
but read_committed readers (the partition's max read position moves on when the marker
lands) and the transaction's completion record; a caller that waits for the markers
(`hurry`, EndTxn/CommitTxn with wait_for_markers) sends them at once, and a marker with
no staging call to ride within `linger_s` goes alone. A marker lingers only while staging
calls to its server come at least every `linger_s` (the last two were that close): a
client that commits now and then sees its data as soon as before, with no wait for a
ride that would not come. A staging call that fails hands its riders back to go alone at
once; so does a partition server that does not answer them (one older than
StageTxnRequest.markers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
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

# How long a marker of a one-call transaction waits for a staging call to ride with (see
# the module doc), by default (the setting coordinator.marker_linger_ms). A client's next
# one-call transaction reaches the coordinator a few ms after the last one's answer
# (measured: 1-3 ms of client CPU plus the queue of a loaded server), but on a cluster the
# staging calls of one coordinator to one partition server came 15-25 ms apart under
# 8 committing clients, so at 20 ms most markers went alone (1.3-1.6 EndTxnOnPartition
# calls per small transaction); at 50 ms 0.1-0.2, with 13-20% less server CPU per
# transaction (docs/benchmarks.md). 50 ms stays well below what a read_committed reader
# already waits for a commit (the marker retry is 1 s).
LINGER_S = 0.050


class MarkerSink(Protocol):
    def markers_confirmed(self, confirmed: list[tuple[TxnId, TopicPartition |
                                                      SubscriptionPartition]],
                          epoch: int) -> None: ...

    def marker_epoch_stale(self, epoch: int) -> None: ...


class MarkerChannel:
    def __init__(self, routes: PartitionRoutes, batch_max: int = 10_000,
                 request_timeout_s: float = 5.0, linger_s: float = LINGER_S):
        self.routes = routes
        self.batch_max = batch_max
        self.request_timeout_s = request_timeout_s
        self.linger_s = linger_s
        self._queues: dict[str, list[tuple[MarkerSink, Marker]]] = defaultdict(list)
        # Markers waiting to ride with a staging call, per address, oldest first:
        # (due time.monotonic(), sink, marker).
        self._lingering: dict[str, list[tuple[float, MarkerSink, Marker]]] = defaultdict(list)
        # Per address, the markers lingering or queued there, as (id(sink), marker): a
        # re-send (every marker_retry_ms, while unconfirmed) of one already on its way
        # adds nothing. Before, a partition server that stayed registered but did not
        # answer took batch_max markers per request timeout while every TC partition
        # re-sent all of its unconfirmed ones each second: the queue grew by thousands a
        # second without bound. Now it holds each unconfirmed marker at most once (and
        # once more while a call carries it).
        self._pending: dict[str, set[tuple[int, Marker]]] = defaultdict(set)
        self._timers: dict[str, asyncio.TimerHandle | None] = {}
        # Per address: when the last staging call went, and the time between the last two.
        self._staged_at: dict[str, float] = {}
        self._staging_gaps: dict[str, float] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self._closed = False

    @property
    def queued(self) -> int:
        return (sum(len(q) for q in self._queues.values())
                + sum(len(q) for q in self._lingering.values()))

    def send(self, sink: MarkerSink, markers,
             may_linger: Callable[[TxnId], bool] | None = None) -> None:
        """Queue markers (never blocks). A marker whose owner is unknown is dropped for
        now (its TC partition re-sends it) and the routes are refreshed. A marker of a
        transaction for which `may_linger` says so (one-call transactions: nothing writes
        to them after the decision) lingers for a staging call (module doc)."""
        unroutable = False
        due = time.monotonic() + self.linger_s
        for marker in markers:
            address = self.routes.cached_owner(marker.target.topic, marker.target.partition)
            if not address:
                unroutable = True
                continue
            if not self._admit(address, sink, marker):
                continue  # lingering or queued already (a re-send)
            if (self.linger_s > 0 and may_linger is not None and may_linger(marker.txn_id)
                    and self._staging_gaps.get(address, math.inf) <= self.linger_s):
                self._lingering[address].append((due, sink, marker))
                self._arm(address)
            else:
                self._queues[address].append((sink, marker))
                self._wake(address)
        if unroutable:
            self._refresh_soon()
        metrics.MARKER_QUEUE.set(self.queued)

    def take_riders(self, address: str, partitions=None) -> list[tuple[MarkerSink, Marker]]:
        """The oldest lingering markers for `address` (a staging call to it is about to
        go), at most batch_max — only those whose (topic, partition) is in `partitions`
        when given: the caller sends them in that call (`request_of`, then `answered` or
        `give_back`)."""
        lingering = self._lingering.get(address)
        if not lingering:
            return []
        if partitions is None:
            taken, self._lingering[address] = (lingering[:self.batch_max],
                                               lingering[self.batch_max:])
            riders = [(sink, marker) for _, sink, marker in taken]
        else:
            riders, staying = [], []
            for entry in lingering:
                target = entry[2].target
                if (target.topic, target.partition) in partitions and \
                        len(riders) < self.batch_max:
                    riders.append((entry[1], entry[2]))
                else:
                    staying.append(entry)
            if riders:
                self._lingering[address] = staying
        self._forget(address, riders)
        return riders

    def _admit(self, address: str, sink: MarkerSink, marker: Marker) -> bool:
        """Whether `marker` may be queued for `address` (noted as on its way there), or
        False: it lingers or is queued there already."""
        pending = self._pending[address]
        key = (id(sink), marker)
        if key in pending:
            return False
        pending.add(key)
        return True

    def _forget(self, address: str, taken: list[tuple[MarkerSink, Marker]]) -> None:
        """`taken` leave for a call: a re-send of one of them queues it again."""
        pending = self._pending[address]
        for sink, marker in taken:
            pending.discard((id(sink), marker))

    def staging_to(self, address: str) -> None:
        """A staging call to `address` is about to go (coordinator/staging.py): markers
        bound there linger for the next one only while such calls are frequent."""
        now = time.monotonic()
        last = self._staged_at.get(address)
        self._staging_gaps[address] = math.inf if last is None else now - last
        self._staged_at[address] = now

    def give_back(self, address: str, riders: list[tuple[MarkerSink, Marker]]) -> None:
        """Riders whose staging call failed or went unanswered: they go alone, now."""
        if riders and not self._closed:
            self._queues[address].extend(  # (one re-sent meanwhile is on its way already)
                (sink, marker) for sink, marker in riders if self._admit(address, sink, marker))
            self._wake(address)

    def hurry(self) -> None:
        """Send every lingering marker now: a caller waits for markers."""
        for address, lingering in self._lingering.items():
            if lingering:
                self._queues[address].extend((sink, marker) for _, sink, marker in lingering)
                lingering.clear()
                self._wake(address)

    def _arm(self, address: str) -> None:
        """A timer that wakes the sender of `address` when its oldest lingering marker is
        due (one per address: lingering markers are due in the order they came)."""
        if self._timers.get(address) is not None or self._closed:
            return
        lingering = self._lingering.get(address)
        if not lingering:
            return
        self._timers[address] = asyncio.get_running_loop().call_later(
            max(0.0, lingering[0][0] - time.monotonic()), self._timer_fired, address)

    def _timer_fired(self, address: str) -> None:
        self._timers[address] = None
        self._wake(address)

    def _take_due(self, address: str) -> None:
        """Move the lingering markers of `address` whose time is up to its queue, and arm
        the timer for the rest."""
        lingering = self._lingering.get(address)
        if not lingering:
            return
        now = time.monotonic()
        count = 0
        for due, _, _ in lingering:
            if due > now:
                break
            count += 1
        if count:
            self._queues[address].extend((sink, marker) for _, sink, marker in lingering[:count])
            del lingering[:count]
        self._arm(address)

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
        self.routes.refresh_soon()

    async def _sender(self, address: str) -> None:
        wakeup = self._wakeups[address]
        while not self._closed:
            await wakeup.wait()
            wakeup.clear()
            try:
                self._take_due(address)
            except Exception:  # noqa: BLE001 — a defect; the queued markers still go
                # Nothing starts a second sender for an address, so this task ending
                # would leave every marker to this server unsent for good (hanging
                # transactions); the lingering ones go at the next wake-up.
                log.exception("taking the due markers to %s failed", address)
            while self._queues[address]:
                queue = self._queues[address]
                batch, self._queues[address] = queue[:self.batch_max], queue[self.batch_max:]
                self._forget(address, batch)
                metrics.MARKER_QUEUE.set(self.queued)
                try:
                    await self._deliver(address, batch)
                except Exception:
                    log.exception("marker delivery to %s failed", address)

    @staticmethod
    def request_of(batch: list[tuple[MarkerSink, Marker]],
                   into: partition_pb2.EndTxnOnPartitionRequest | None = None) -> tuple[
            partition_pb2.EndTxnOnPartitionRequest, tuple]:
        """The request for `batch` (built in `into` when given) — one TxnMarker per
        (sender, transaction, decision, epoch), targets in order — and what `answered`
        needs to read its response."""
        grouped: dict[tuple, list[Marker]] = {}
        for sink, marker in batch:
            key = (id(sink), marker.txn_id, marker.decision, marker.coordinator_epoch)
            grouped.setdefault(key, []).append(marker)
        sinks = {id(sink): sink for sink, _ in batch}
        keys = list(grouped)
        request = partition_pb2.EndTxnOnPartitionRequest() if into is None else into
        request.markers.extend(_to_proto(grouped[key]) for key in keys)
        return request, (keys, grouped, sinks)

    async def _deliver(self, address: str, batch: list[tuple[MarkerSink, Marker]]) -> None:
        request, sent = self.request_of(batch)
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
        self.answered(response, sent)

    def answered(self, response: partition_pb2.EndTxnOnPartitionResponse, sent: tuple) -> None:
        """Confirm each target the response says is done back to its TC partition."""
        keys, grouped, sinks = sent
        refresh = False
        # Per (sink, epoch), every target confirmed: one call each, in order.
        confirmed: dict[tuple[int, int], list] = {}
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
            txn_id = markers[0].txn_id
            for target, reason in zip(targets, errors):
                if not reason:
                    metrics.MARKERS_CONFIRMED.inc()
                    confirmed.setdefault((key[0], epoch), []).append((txn_id, target))
                elif reason == "STALE_COORDINATOR_EPOCH":
                    metrics.MARKER_FAILURES.labels(reason).inc()
                    sink.marker_epoch_stale(epoch)
                    break
                else:
                    metrics.MARKER_FAILURES.labels(reason).inc()
                    refresh |= reason in ROUTING_REASONS
        for (sink_id, epoch), pairs in confirmed.items():
            sinks[sink_id].markers_confirmed(pairs, epoch)
        if refresh:
            self._refresh_soon()

    async def close(self) -> None:
        self._closed = True
        for timer in self._timers.values():
            if timer is not None:
                timer.cancel()
        tasks = list(self._senders.values())
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
