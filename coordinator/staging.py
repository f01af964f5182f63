"""The staging channel: StageTxn calls from a coordinator to partition servers.

A one-call transaction (CoordinatorService.CommitTxn) is staged on the partition servers
before its decision is logged. `stage()` splits its batches and acks by the server that
owns each partition and queues one part per server (services/batching.py): everything
queued for a server goes in one call (up to `batch_max` transactions), so while a call
is in flight the next transactions queue and leave together in the next one: under load
the calls per transaction fall below one per server, with no linger of its own.

A part that fails with a retriable reason (the owner moved, loading, unreachable,
timeouts) is routed again and resent — staging is idempotent per transaction and
partition at the server — until the transaction's deadline; any other refusal (a bad
batch, a conflicting ack, a stale coordinator epoch) fails the transaction at once.

`resolve()` asks the partition servers about a parallel commit that nobody decided
(PartitionService.ResolveStaged; docs/coordinator.md, "Parallel commits"): whether the
transaction's staged batch is durable on each of its partitions (and its staged ack on
each subscription partition it acked), each server fencing the TC partition at the asking
coordinator's epoch first.

The TC logs' appends to a partition server ride in the same queue (`submit_append`,
coordinator/txn_log.py AppendChannel) while it is busy: a decision whose log lives on a
server that stages now leaves with the next staging call there, in
StageTxnRequest.appends, and shares that server's write-ahead round, instead of a
Produce call of its own beside it. With `settle_turns`, that next call waits a few
event-loop turns after the answers of the one before, so that the decisions those
answers lead to join it.
A server that does not know the field (an older one: it answers no `appends`) gets them
by Produce, now and for NO_APPENDS_S after; their producer sequence makes a resend safe.

`stage_chain()` stages the transactions of one CommitTxns call in order (a client's
pipelined commits of the same producers): on every partition an earlier transaction's
batches reach the log first, and a transaction that must retry breaks the chain (the
later ones fail with EARLIER_COMMIT_FAILED instead of racing its retries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from atomlog.v1 import common_pb2, partition_pb2

from coordinator.markers import MarkerChannel
from coordinator.records import SubscriptionPartition, TopicPartition, TxnId
from coordinator.routing import PartitionRoutes
from services import failpoints, local
from services.backoff import Backoff
from services.batching import PerDestination
from services.errors import AtomlogError, from_rpc_error
from services.fastmetrics import Counter, Histogram
from services.logs import event
from services.metrics import LATENCY_BUCKETS_SECONDS

log = logging.getLogger("atomlog.coordinator.staging")

STAGE_CALLS = Counter("atomlog_coordinator_stage_calls_total",
                      "StageTxn calls sent to partition servers (each carries the parts of "
                      "many one-call transactions).")
STAGED = Counter("atomlog_coordinator_staged_transactions_total",
                 "One-call transactions staged on every partition server (ok), or refused "
                 "by one of them, by the refusal's reason.", ["result"])
RIDING_MARKERS = Counter("atomlog_coordinator_riding_markers_total",
                         "Markers (one per transaction and partition) sent inside a StageTxn "
                         "call instead of an EndTxnOnPartition call of their own.")
RIDING_APPENDS = Counter("atomlog_coordinator_riding_appends_total",
                         "TC-log appends sent inside a StageTxn call instead of a Produce "
                         "call.")
APPENDS_NOT_TAKEN = Counter("atomlog_coordinator_riding_appends_not_taken_total",
                            "TC-log appends a partition server did not take inside a StageTxn "
                            "call (one from before StageTxnRequest.appends, or a call refused "
                            "whole), sent by Produce instead.")
RESOLVE_CALLS = Counter("atomlog_coordinator_resolve_staged_calls_total",
                        "ResolveStaged calls sent to partition servers (resolving parallel "
                        "commits that nobody decided).")
STAGE_SECONDS = Histogram("atomlog_coordinator_stage_duration_seconds",
                          "Time to stage a one-call transaction on every partition server "
                          "(queueing and retries included).", buckets=LATENCY_BUCKETS_SECONDS)

PARTITION_SERVICE = "atomlog.v1.PartitionService"
RETRY_REASONS = frozenset({"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                           "SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT", "SHUTTING_DOWN",
                           "PARTITION_LOADING", "RESOURCE_EXHAUSTED", "CONCURRENT_TRANSACTIONS",
                           "ZOOKEEPER_UNAVAILABLE"})
ROUTING_REASONS = frozenset({"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                             "SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT"})
# A staging call that failed for one of these did not reach its server, or did not
# come back in time: a Produce call now would meet the same, so the appends in it fail
# with it (the TC log's writer retries the same batch). Any other failure of the whole
# call sends them by Produce at once.
UNREACHED_REASONS = frozenset({"SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT", "SHUTTING_DOWN"})
# Appends above this size (snapshot chunks) keep to Produce calls: a staging call stays
# small (it has no bound of bytes of its own).
APPEND_RIDER_MAX_BYTES = 64 << 10
# A server that answered no `appends` (one that does not know the field), or failed a
# call carrying them whole, gets none riding for this long.
NO_APPENDS_S = 60.0
# One resolve() asks for at most this long (retrying what fails for a retriable reason),
# then answers None: the TC partition asks again at a later tick.
RESOLVE_WINDOW_S = 10.0


@dataclass(eq=False)
class _Part:
    """What one transaction stages on one server, and its outcome."""

    txn_id: TxnId
    epoch: int
    batches: list[tuple[int, partition_pb2.ProduceItem]]  # (index in the request, item)
    acks: list[partition_pb2.AckItem]


@dataclass(eq=False)
class StageOrder:
    """One transaction to stage (StageChannel.stage_chain)."""

    txn_id: TxnId
    epoch: int
    batches: list  # ProduceItem
    acks: list  # AckItem
    deadline: float  # time.monotonic()


class _Attempt:
    """What staging one transaction has got so far: results per batch, and what failed
    in the last round (with the lists to retry it in)."""

    def __init__(self, order: StageOrder):
        self.order = order
        self.results: list = [None] * len(order.batches)
        self.todo_batches = list(enumerate(order.batches))
        self.todo_acks = list(order.acks)
        self.failed: list = []  # (ItemError or AtomlogError, list to retry it in, item, where)
        self.retry_batches: list = []
        self.retry_acks: list = []

    def collect(self, parts: dict, outcomes: list) -> None:
        """Take one round's outcomes (one per part, in order)."""
        self.retry_batches, self.retry_acks = [], []
        for part, outcome in zip(parts.values(), outcomes):
            if isinstance(outcome, BaseException):
                error = outcome if isinstance(outcome, AtomlogError) else AtomlogError(
                    "INTERNAL", f"staging failed: {outcome}")
                self.failed.append((error, self.retry_batches, None, ""))
                self.retry_batches.extend(part.batches)
                self.retry_acks.extend(part.acks)
                continue
            for (index, item), result in zip(part.batches, outcome.batch_results):
                if result.error.reason:
                    tp = item.topic_partition
                    self.failed.append((result.error, self.retry_batches, (index, item),
                                        f"{tp.topic}-{tp.partition}"))
                else:
                    self.results[index] = result
            for ack, result in zip(part.acks, outcome.ack_results):
                if result.error.reason:
                    sp = ack.subscription_partition
                    self.failed.append((result.error, self.retry_acks, ack,
                                        f"{sp.topic}-{sp.partition} (subscription "
                                        f"{sp.subscription})"))


class StageChannel:
    def __init__(self, routes: PartitionRoutes, batch_max: int = 1_000,
                 request_timeout_s: float = 5.0, markers: "MarkerChannel | None" = None,
                 settle_turns: int = 0):
        self.routes = routes
        self.request_timeout_s = request_timeout_s
        self.markers = markers  # lingering markers ride with the calls (markers.py)
        self._calls = PerDestination(self._send, what="staging", max_items=batch_max,
                                     settle_turns=settle_turns)
        self._closed = False
        # Produce(address, items) -> results, raising AtomlogError: set by the AppendChannel
        # whose appends ride here (the way to a server that does not take them).
        self.produce = None
        self._no_appends: dict[str, float] = {}  # address -> until (time.monotonic())

    def takes_append(self, address: str, item: partition_pb2.ProduceItem) -> bool:
        """Whether a TC-log append `item` to `address` (another process) rides with the
        staging calls there (`submit_append`): while a staging call to it is in flight
        or parts wait for one. Else it goes by a Produce call at once, beside the
        staging calls, as a lone commit's decision did before: sent as a staging call
        of its own, it would hold the next transaction's parts to that server for a
        round (measured, docs/benchmarks.md "The fifty-third session": riding always,
        pipelined consume-transform-produce's commit p99 was 42-50 ms against 30-32)."""
        if self._closed or self.produce is None or not self._calls.busy(address) or \
                item.ByteSize() > APPEND_RIDER_MAX_BYTES:
            return False
        until = self._no_appends.get(address)
        if until is not None:
            if time.monotonic() < until:
                return False
            del self._no_appends[address]
        return True

    def submit_append(self, address: str, item: partition_pb2.ProduceItem) -> asyncio.Future:
        """`item` queued for the next StageTxn call to `address`: the future of its
        ProduceResult (failing with the call's AtomlogError when the call did not reach
        the server or come back in time: UNREACHED_REASONS)."""
        return self._calls.submit(address, item)

    async def stage(self, txn_id: TxnId, epoch: int, batches, acks,
                    deadline: float) -> list[partition_pb2.ProduceResult]:
        """Stage every batch (ProduceItem) and ack (AckItem) of a transaction, each
        durable on its partition server, by `deadline` (time.monotonic()); returns where
        each batch was written, in request order. Raises the first definite refusal, or
        the last retriable one when time runs out."""
        [outcome] = await self.stage_chain([StageOrder(txn_id, epoch, batches, acks, deadline)])
        if isinstance(outcome, AtomlogError):
            raise outcome
        return outcome

    async def stage_chain(self, orders: list["StageOrder"]) -> list:
        """Stage several transactions in order (CoordinatorService.CommitTxns): on every
        partition a transaction's batches reach the log before those of the transactions
        after it. Every part of every transaction is queued before anything is awaited
        (so they ride in the same calls, in order: PerDestination keeps one call in
        flight per server, and the server queues a call's items in request order); the
        first transaction with a part that fails then goes on alone as stage() does,
        and every later one answers EARLIER_COMMIT_FAILED without a retry: a retried
        part of the earlier one could otherwise land after theirs. Returns, per order,
        its batch results (as stage()) or the AtomlogError it failed with."""
        began = time.perf_counter()
        try:
            splits = []
            for order in orders:
                try:
                    splits.append(await self._split(order.txn_id, order.epoch,
                                                    list(enumerate(order.batches)),
                                                    list(order.acks)))
                except AtomlogError as error:  # no live owner known: route again
                    splits.append(error)
            # No await from the first submit to the last: the order holds on each server.
            sent = [parts if isinstance(parts, AtomlogError) else
                    [(address, part, self._submit(address, part))
                     for address, part in parts.items()]
                    for parts in splits]
            outcomes = []
            for order, queued in zip(orders, sent):
                outcomes.append(queued if isinstance(queued, AtomlogError) else
                                await self._await_parts(queued, order.deadline))
            answers: list = []
            broken = None  # the transaction that breaks the chain
            for order, parts, outcome in zip(orders, splits, outcomes):
                if broken is not None:
                    STAGED.labels("EARLIER_COMMIT_FAILED").inc()
                    answers.append(AtomlogError(
                        "EARLIER_COMMIT_FAILED", f"transaction {broken} before this one in "
                        "the call did not stage at its first attempt"))
                    continue
                attempt = _Attempt(order)
                if isinstance(parts, AtomlogError):
                    attempt.failed.append((parts, [], None, ""))
                else:
                    attempt.collect(parts, outcome)
                if not attempt.failed:
                    STAGED.labels("ok").inc()
                    answers.append(attempt.results)
                    continue
                broken = order.txn_id
                try:
                    answers.append(await self._retry(
                        attempt, not isinstance(parts, AtomlogError) and bool(parts)))
                except AtomlogError as error:
                    answers.append(error)
            return answers
        finally:
            STAGE_SECONDS.observe(time.perf_counter() - began)

    async def _retry(self, attempt: "_Attempt", routed: bool):
        """Go on staging what failed at the first attempt, until done or a definite
        refusal or the deadline (raised)."""
        order = attempt.order
        backoff = Backoff(initial_s=0.02, maximum_s=0.5)
        number = 1
        while True:
            refresh, last = False, None
            for error, retry, item, where in attempt.failed:
                if error.reason not in RETRY_REASONS:
                    STAGED.labels(error.reason).inc()
                    raise _error_of(error, where)
                refresh |= error.reason in ROUTING_REASONS
                if item is not None:
                    retry.append(item)
                last = _error_of(error)
            if routed:
                attempt.todo_batches, attempt.todo_acks = attempt.retry_batches, attempt.retry_acks
            if refresh:
                await self.routes.refresh(force=True)
            delay = backoff.delay(number)
            if time.monotonic() + delay >= order.deadline:
                raise last
            await asyncio.sleep(delay)
            number += 1
            attempt.failed = []
            try:
                parts = await self._split(order.txn_id, order.epoch, attempt.todo_batches,
                                          attempt.todo_acks)
            except AtomlogError as error:  # no live owner known: route again
                attempt.failed.append((error, [], None, ""))
                routed = False
                continue
            routed = bool(parts)
            attempt.collect(parts, await self._send_parts(parts, order.deadline))
            if not attempt.failed:
                STAGED.labels("ok").inc()
                return attempt.results

    async def _split(self, txn_id: TxnId, epoch: int, batches, acks) -> dict[str, _Part]:
        parts: dict[str, _Part] = {}
        for index, item in batches:
            tp = item.topic_partition
            address = await self.routes.owner(tp.topic, tp.partition)
            parts.setdefault(address, _Part(txn_id, epoch, [], [])).batches.append((index, item))
        for ack in acks:
            sp = ack.subscription_partition
            address = await self.routes.owner(sp.topic, sp.partition)
            parts.setdefault(address, _Part(txn_id, epoch, [], [])).acks.append(ack)
        return parts

    async def _send_parts(self, parts: dict[str, _Part], deadline: float) -> list:
        """The outcome (StageTxnResult or the exception) of each part, in order. Every
        part is queued on its server's channel first, then each is awaited in this task
        (all to the same deadline): no task per part, as gather would make."""
        return await self._await_parts([(address, part, self._submit(address, part))
                                        for address, part in parts.items()], deadline)

    def _submit(self, address: str, part: _Part) -> asyncio.Future:
        if self._closed:
            future = asyncio.get_running_loop().create_future()
            future.set_exception(AtomlogError("SHUTTING_DOWN", "the coordinator is stopping"))
            return future
        return self._calls.submit(address, part)

    async def _await_parts(self, queued: list, deadline: float) -> list:
        """The outcome of each queued (address, part, future), in order (as _send_parts):
        its result, or the exception it raised (as gather(return_exceptions=True)), or
        REQUEST_TIMED_OUT if it did not end by `deadline`. One wait for all of them (one
        timer, not one per part)."""
        futures = [future for _, _, future in queued]
        if not all(future.done() for future in futures):
            # wait(), not wait_for(shield()): neither a timeout nor a cancelled caller
            # cancels the parts' futures (other transactions' parts share their calls).
            await asyncio.wait(futures, timeout=max(0.01, deadline - time.monotonic()))
        outcomes = []
        for address, _, future in queued:
            if not future.done():
                outcomes.append(AtomlogError(
                    "REQUEST_TIMED_OUT", f"staging on {address} did not answer within the "
                    "transaction's time"))
                continue
            try:
                outcomes.append(future.result())
            except Exception as error:  # noqa: BLE001 — as gather(return_exceptions=True)
                outcomes.append(error)
        return outcomes

    async def _send(self, address: str, group: list) -> list:
        """One StageTxn call for the parts and TC-log appends queued for `address`: a
        result per entry, in order (a part's StageTxnResult, an append's ProduceResult).
        Lingering markers bound for `address` ride in it (`_riders`, coordinator/markers.py)."""
        parts = [entry for entry in group if isinstance(entry, _Part)]
        appends = [entry for entry in group if not isinstance(entry, _Part)]
        request = partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
            txn_id=common_pb2.TxnId(tc_partition=p.txn_id.tc_partition,
                                    sequence=p.txn_id.sequence),
            coordinator_epoch=p.epoch, batches=[item for _, item in p.batches],
            acks=p.acks) for p in parts])
        if appends:
            request.appends.items.extend(appends)
            RIDING_APPENDS.inc(len(appends))
        if self.markers is not None:
            self.markers.staging_to(address)
        riders = self._riders(address, parts)
        sent = None
        if riders:
            _, sent = self.markers.request_of(riders, into=request.markers)
            RIDING_MARKERS.inc(len(riders))
        STAGE_CALLS.inc()
        try:
            response = await self.routes.stub(address).StageTxn(
                request, timeout=self.request_timeout_s)
        except BaseException as error:
            if riders:
                self.markers.give_back(address, riders)
            if isinstance(error, grpc.RpcError):
                error = from_rpc_error(error)
            if not appends or not isinstance(error, AtomlogError) or \
                    error.reason in UNREACHED_REASONS:
                raise error from None  # every entry fails with it (an append is retried)
            # Refused whole (a bad part, a server that takes no appends without items, or
            # one failing on them): the parts fail with it; the appends go by Produce now,
            # answered on their own, and ride there no more for a while.
            self._no_appends[address] = time.monotonic() + NO_APPENDS_S
            return _merged(group, [error] * len(parts), await self._by_produce(address, appends))
        if riders:
            if len(response.markers.results) == len(request.markers.markers):
                self.markers.answered(response.markers, sent)
            else:  # a server that does not know StageTxnRequest.markers
                self.markers.give_back(address, riders)
        if len(response.results) != len(parts):
            raise AtomlogError("INTERNAL", f"StageTxn on {address} answered "
                               f"{len(response.results)} results for {len(parts)} items")
        if not appends:
            return list(response.results)
        if len(response.appends.results) == len(appends):
            answers = list(response.appends.results)
        else:  # a server that does not know StageTxnRequest.appends
            self._no_appends[address] = time.monotonic() + NO_APPENDS_S
            answers = await self._by_produce(address, appends)
        return _merged(group, list(response.results), answers)

    async def _by_produce(self, address: str, appends: list) -> list:
        """The appends sent by one Produce call: its results, or its failure for each."""
        APPENDS_NOT_TAKEN.inc(len(appends))
        try:
            return await self.produce(address, appends)
        except AtomlogError as error:
            return [error] * len(appends)

    def _riders(self, address: str, parts: list[_Part]) -> list:
        """The lingering markers to ride with this call (none while the markers_send
        failpoint holds markers): all of them to another process, only those for the
        partitions it stages on to this one (coordinator/markers.py)."""
        if self.markers is None or failpoints.armed(failpoints.MARKERS_SEND):
            return []
        if not local.servicer(address, PARTITION_SERVICE):
            return self.markers.take_riders(address)
        partitions = set()
        for part in parts:
            for _, item in part.batches:
                partitions.add((item.topic_partition.topic, item.topic_partition.partition))
            for ack in part.acks:
                partitions.add((ack.subscription_partition.topic,
                                ack.subscription_partition.partition))
        return self.markers.take_riders(address, partitions)

    async def resolve(self, txn_id: TxnId, epoch: int,
                      targets: tuple[TopicPartition | SubscriptionPartition, ...]
                      ) -> bool | None:
        """A parallel commit's resolution (ResolveStaged on the owner of each partition
        and of each acked subscription partition): True when its staged batch (or ack)
        is durable on every one, False as soon as one has none (fenced there: it never
        will), None when not every answer came within RESOLVE_WINDOW_S. Raises a
        definite refusal (a stale epoch: this coordinator was deposed)."""
        todo = list(dict.fromkeys(targets))
        deadline = time.monotonic() + RESOLVE_WINDOW_S
        backoff = Backoff(initial_s=0.05, maximum_s=1.0)
        number = 0
        while True:
            retry: list[TopicPartition | SubscriptionPartition] = []
            refresh = False
            groups: dict[str, list[TopicPartition | SubscriptionPartition]] = {}
            for target in todo:
                try:
                    address = await self.routes.owner(target.topic, target.partition)
                except AtomlogError:  # no live owner known: route again
                    retry.append(target)
                    refresh = True
                    continue
                groups.setdefault(address, []).append(target)
            outcomes = await asyncio.gather(*(self._ask(address, txn_id, epoch, group)
                                              for address, group in groups.items()),
                                            return_exceptions=True)
            for group, outcome in zip(groups.values(), outcomes):
                if isinstance(outcome, AtomlogError):  # the call failed: each target
                    failures = [(target, outcome) for target in group]
                elif isinstance(outcome, BaseException):
                    raise outcome
                elif any(not e.error.reason and not e.staged for _, e in outcome):
                    return False
                else:
                    failures = [(target, e.error) for target, e in outcome if e.error.reason]
                for target, error in failures:
                    if error.reason not in RETRY_REASONS:
                        raise _error_of(error, _target_name(target))
                    refresh |= error.reason in ROUTING_REASONS
                    retry.append(target)
            if not retry:
                return True
            todo, number = retry, number + 1
            delay = backoff.delay(number)
            if time.monotonic() + delay >= deadline:
                return None
            if refresh:
                await self.routes.refresh(force=True)
            await asyncio.sleep(delay)

    async def _ask(self, address: str, txn_id: TxnId, epoch: int,
                   targets: list[TopicPartition | SubscriptionPartition]) -> list[tuple]:
        """One ResolveStaged call: (target, its StagedPartition or
        StagedSubscriptionPartition) for each of `targets`."""
        tps = [t for t in targets if not isinstance(t, SubscriptionPartition)]
        sps = [t for t in targets if isinstance(t, SubscriptionPartition)]
        request = partition_pb2.ResolveStagedRequest(items=[partition_pb2.ResolveStagedItem(
            txn_id=common_pb2.TxnId(tc_partition=txn_id.tc_partition, sequence=txn_id.sequence),
            coordinator_epoch=epoch,
            topic_partitions=[common_pb2.TopicPartition(topic=tp.topic, partition=tp.partition)
                              for tp in tps],
            subscription_partitions=[common_pb2.SubscriptionPartition(
                topic=sp.topic, partition=sp.partition, subscription=sp.subscription)
                for sp in sps])])
        RESOLVE_CALLS.inc()
        try:
            response = await self.routes.stub(address).ResolveStaged(
                request, timeout=self.request_timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        [result] = response.results
        if len(result.partitions) != len(tps) or \
                len(result.subscription_partitions) != len(sps):
            raise AtomlogError("INTERNAL", f"ResolveStaged on {address} answered "
                               f"{len(result.partitions)} partitions and "
                               f"{len(result.subscription_partitions)} subscription "
                               f"partitions for {len(tps)} and {len(sps)}")
        return [*zip(tps, result.partitions), *zip(sps, result.subscription_partitions)]

    async def close(self) -> None:
        self._closed = True
        await self._calls.close()
        event(log, "staging channel closed", calls=self._calls.calls)


def _merged(group: list, part_answers: list, append_answers: list) -> list:
    """The answers of a call's entries in their order, from the parts' and the appends'."""
    parts, appends = iter(part_answers), iter(append_answers)
    return [next(parts) if isinstance(entry, _Part) else next(appends) for entry in group]


def _target_name(target) -> str:
    if isinstance(target, SubscriptionPartition):
        return f"{target.topic}-{target.partition} (subscription {target.subscription})"
    return f"{target.topic}-{target.partition}"


def _error_of(error, where: str = "") -> AtomlogError:
    """An AtomlogError from an ItemError (or an AtomlogError), naming where it happened."""
    message = error.message + (f" ({where})" if where else "")
    return AtomlogError(error.reason, message, dict(error.metadata))
