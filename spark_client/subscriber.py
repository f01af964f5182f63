"""A consumer of a named subscription: the server keeps a durable cursor per partition,
delivers each message to one consumer at a time, and redelivers what is not acknowledged
within the ack timeout or is negatively acknowledged.

    with client.consumer("orders", subscription="billing") as consumer:
        for message in consumer.poll(timeout_s=1.0):
            handle(message)
            consumer.ack(message)              # or ack_cumulative(last), nack(message)

Transactional acks (`ack(messages, txn=txn)`, `ack_cumulative(message, txn=txn)`) stay
pending until the transaction ends: a commit applies them, an abort makes the messages
redeliverable. The subscription partition is registered with the transaction first; the
server verifies that with the coordinator. An ack of a message pending in another open
transaction raises TransactionConflict.

`ack_async()` and `ack_cumulative_async()` return a future at once and send the ack from
one thread of the consumer, in call order. With a transaction, the transaction waits for
the future before it commits (and aborts, raising its error, if the ack failed), so a
consume-transform-produce loop can go on producing while the ack — and the NewTxn it may
open — travel:

    txn = client.begin_transaction()
    consumer.ack_async(messages, txn=txn)          # NewTxn + Ack on the consumer's thread
    for m in messages:
        producer.send("out", transform(m), txn=txn)
    txn.commit_async()                             # or commit(): waits for the ack first
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import grpc
import pyarrow as pa

from atomlog.v1 import common_pb2, partition_pb2
from partition_server.record_batch import iter_batches
from services.backoff import Backoff
from spark_client import errors, link
from spark_client.transactions import KeptBy
from spark_client.consumer import ISOLATION
from spark_client.fetched import Fetched, Message, block_of

_ROUTING = {"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION", "SERVER_UNAVAILABLE"}
MAX_MESSAGES_PER_RECEIVE = (1 << 32) - 1  # ReceiveRequest.max_messages is a uint32
_POSITIONS = {"earliest": partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST,
              "latest": partition_pb2.SUBSCRIPTION_INITIAL_POSITION_LATEST,
              "offset": partition_pb2.SUBSCRIPTION_INITIAL_POSITION_OFFSET,
              "timestamp": partition_pb2.SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP}


def subscription_position(name: str, offset: int | None = None, timestamp_ms: int | None = None,
                          *, what: str = "to", offset_name: str = "offset",
                          timestamp_name: str = "timestamp_ms") -> int:
    """The proto position for `name` ("earliest", "latest", "offset" or "timestamp"),
    after checking that the offset or timestamp comes with (and only with) its kind and
    is not negative; ValueError names the arguments as `what`, `offset_name` and
    `timestamp_name` (the CLI passes its flags)."""
    if name not in _POSITIONS:
        raise ValueError(f"{what} must be one of {sorted(_POSITIONS)}")
    if (name == "offset") != (offset is not None) or \
            (name == "timestamp") != (timestamp_ms is not None):
        raise ValueError(f"{offset_name} goes with {what}='offset', {timestamp_name} with "
                         f"{what}='timestamp'")
    for value, field in ((offset, offset_name), (timestamp_ms, timestamp_name)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{field} must be a non-negative integer")
    return _POSITIONS[name]


class SubscriptionConsumer:
    def __init__(self, client, topics: list[str] | str, *, subscription: str,
                 isolation: str = "read_committed", start: str = "earliest",
                 start_offset: int | None = None, start_timestamp_ms: int | None = None,
                 ack_timeout_s: float = 30.0, max_bytes_per_request: int = 8 << 20,
                 request_timeout_s: float = 30.0, max_async_acks: int = 64,
                 prefetch: int = 0):
        """`start` places the cursors this consumer creates (existing ones stay where
        they are): "earliest" (everything stored), "latest" (only new messages),
        "offset" (`start_offset`, clamped to what each partition holds) or "timestamp"
        (`start_timestamp_ms`: each partition's first message at or after it).
        `max_async_acks` bounds the acks begun with ack_async() and not yet answered: a
        further call waits for one of them. `prefetch` (as RabbitMQ's prefetch count):
        messages a Receive asks for beyond the poll's max_records, kept here for the next
        polls, so a worker polling small batches makes one Receive per several polls.
        When a poll leaves at most half of that (max_records + prefetch) kept, the next
        Receive, for the difference, is sent in the background at once (as Kafka's
        consumer sends its next fetch while the application works), so the polls after
        find it here instead of waiting for the server. They are delivered (their ack
        timeout runs) from that Receive on, and what is still kept when the ack timeout
        passes is dropped here and redelivered by the server; 0 (the default) asks for
        max_records only and sends nothing in the background. A server that restarts (or a
        partition whose leadership moves) forgets its deliveries and gives them to other
        consumers: messages kept here from before may then be acked by others first, and
        a transactional ack of them fails with TRANSACTION_CONFLICT (exactly once holds;
        the work on them is lost). `received_at` (time.time()) says when the Receive that
        delivered what poll() returns was sent."""
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {sorted(ISOLATION)}")
        if max_async_acks < 1:
            raise ValueError("max_async_acks must be at least 1")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError("prefetch must be a non-negative integer")
        initial = subscription_position(start, start_offset, start_timestamp_ms, what="start",
                                        offset_name="start_offset",
                                        timestamp_name="start_timestamp_ms")
        self.client = client
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.subscription = subscription
        self.isolation = isolation
        self.ack_timeout_ms = int(ack_timeout_s * 1000)
        self.max_bytes_per_request = max_bytes_per_request
        self.request_timeout_s = request_timeout_s
        self.prefetch = prefetch
        self.consumer_id = f"{subscription}-{uuid.uuid4()}"
        self.backoff = Backoff()
        self._closed = False
        # One-call transactions holding acks of this consumer (reset() sends them first).
        self._kept_by = KeptBy()
        self._fetched = Fetched()  # delivered, not yet returned by poll
        self._buffer_expires = 0.0
        # The background Receive topping up what is kept (prefetch): a future of
        # (Fetched, when it was sent: monotonic, time.time()), taken when _fetched is
        # empty; at most one at a time, on its own thread.
        self._top_up_call: concurrent.futures.Future | None = None
        self._top_up_executor: concurrent.futures.ThreadPoolExecutor | None = None
        # time.time() when the Receive that delivered what poll() hands out was sent.
        self.received_at: float | None = None
        self._async_slots = threading.BoundedSemaphore(max_async_acks)
        self._async_lock = threading.Lock()
        self._async_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.partitions = [(t, r.partition) for t in self.topics
                           for r in client.metadata.partitions(t)]
        self._receive_turns = 0  # rotates the partitions' order in Receives (_receive_order)
        self._call_all("CreateSubscription", lambda group: partition_pb2.CreateSubscriptionRequest(
            subscription_partitions=[self._sp(t, p) for t, p in group],
            initial_position=initial, start_offset=start_offset or 0,
            timestamp_unix_ms=start_timestamp_ms or 0))

    # ------------------------------------------------------------------ plumbing
    def _sp(self, topic: str, partition: int) -> common_pb2.SubscriptionPartition:
        return common_pb2.SubscriptionPartition(topic=topic, partition=partition,
                                                subscription=self.subscription)

    def _by_server(self, partitions) -> dict[str, list[tuple[str, int]]]:
        servers: dict[str, list[tuple[str, int]]] = {}
        for topic, partition in partitions:
            address = self.client.metadata.route(topic, partition).address
            servers.setdefault(address, []).append((topic, partition))
        return servers

    def _call_all(self, method: str, build, partitions=None, *, timeout_s: float | None = None,
                  attempts: int = 8) -> list:
        """`method` on every server owning some of `partitions` (default: all), each
        request built by build(group), the servers called at once; retried on routing
        and retriable item errors. Returns the results (each with an error field) of the
        last attempt."""
        pending = list(partitions if partitions is not None else self.partitions)
        results = []
        for attempt in range(1, attempts + 1):
            retry, last, answered = self._call_once(method, build, pending,
                                                    timeout_s or self.request_timeout_s)
            results.extend(answered)
            if not retry:
                return results
            pending = retry
            if attempt == attempts:
                raise last or errors.error_for("SERVER_UNAVAILABLE", "owners unreachable")
            time.sleep(self.backoff.delay(attempt))
        return results

    def _call_once(self, method: str, build, partitions, timeout_s: float):
        """One round of `method`: the servers owning `partitions` are called at once.
        Returns (partitions to retry, the last error, the other results). A call failing
        for good raises once every call of the round has answered — except for Receive,
        whose caller gets it as the last error (so what the other servers delivered is
        not lost). Routing errors invalidate the metadata of their topics."""
        retry: list[tuple[str, int]] = []
        last: errors.AtomlogClientError | None = None
        fatal: errors.AtomlogClientError | None = None
        results = []
        planned = []
        for address, group in self._by_server(partitions).items():
            if not address:
                retry.extend(group)
                last = errors.error_for("SERVER_UNAVAILABLE", "no owner of "
                                        + ", ".join(f"{t}-{p}" for t, p in group) + " is up")
                continue
            planned.append((group, *link.partition_call(self.client, address, method),
                            build(group)))
        # Several servers are called at once (futures: gRPC's, or a link's call on the
        # links' threads); one is called blocking: a future on an idle channel starts a
        # thread to drive it, which cost 0.23 ms of client CPU and 1.2 ms of latency per
        # call (measured: 340-375 against 122-141 us of CPU).
        calls = ([(group, link.Deferred(call, request, timeout_s))
                  for group, call, _, request in planned] if len(planned) == 1 else
                 [(group, call.future(request, timeout=timeout_s) if over_grpc
                   else self.client.links.submit(call, request, timeout_s))
                  for group, call, over_grpc, request in planned])
        for group, call in calls:
            try:
                reply = call.result()
            except grpc.RpcError as rpc_error:
                error = errors.from_grpc(rpc_error)
                if not error.retriable:
                    fatal = fatal or error
                retry.extend(group)
                last = error
                continue
            items = list(reply.cursors if method == "DescribeSubscription" else reply.results)
            for (topic, partition), result in zip(group, items):
                reason = result.error.reason
                if reason and (reason in _ROUTING or errors.error_for(reason, "").retriable):
                    retry.append((topic, partition))
                    last = errors.error_for(reason, result.error.message,
                                            dict(result.error.metadata))
                else:
                    results.append(result)
        if fatal is not None and method != "Receive":
            raise fatal
        for topic in {t for t, _ in retry}:
            self.client.metadata.invalidate(topic)
        return retry, last if fatal is None else fatal, results

    @staticmethod
    def _raise(results) -> None:
        for result in results:
            if result.error.reason:
                raise errors.error_for(result.error.reason, result.error.message,
                                       dict(result.error.metadata))

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout_s: float = 1.0, max_records: int = 10_000) -> list[Message]:
        """Up to max_records messages delivered to this consumer, waiting up to timeout_s
        for the first. The Receive asks each server for its share of max_records
        (max_messages), so what this consumer did not ask for stays on the servers for
        other consumers. (What comes back beyond max_records — one message per server
        when max_records is smaller than the number of servers, or anything from a server
        that ignores the bound — waits in this consumer for the next poll, unless its ack
        timeout passed meanwhile, when it is dropped and the server redelivers it.) Partitions whose owner does not answer
        are retried within timeout_s; if nothing was delivered and some partition still
        failed, its (retriable) error is raised."""
        self._wait_for_data(timeout_s, max_records)
        messages = self._fetched.take_messages(max_records)
        self._top_up(max_records)
        return messages

    def poll_arrow(self, timeout_s: float = 1.0, max_records: int = 10_000) -> pa.Table:
        """poll() as a pyarrow Table (topic, partition, offset, key, value, headers,
        timestamp: spark_client.fetched.TABLE_SCHEMA), empty when nothing was delivered
        within timeout_s; no Python object per record. ack(table) acknowledges its rows."""
        self._wait_for_data(timeout_s, max_records)
        table = self._fetched.take_table(max_records)
        self._top_up(max_records)
        return table

    def _wait_for_data(self, timeout_s: float, max_records: int) -> None:
        if self._closed:
            raise RuntimeError("consumer is closed")
        if max_records < 1:
            raise ValueError("max_records must be at least 1")
        if self._fetched and time.monotonic() >= self._buffer_expires:
            self._fetched.clear()
        if not self._fetched:
            self._take_top_up()
        if not self._fetched:
            self._receive(timeout_s, max_records)

    def _top_up(self, max_records: int) -> None:
        """After a poll: with a prefetch, once what is kept is at most half of what a
        Receive asks for, send the next Receive (for the difference) in the background,
        unless one is out already."""
        if not self.prefetch or self._closed or self._top_up_call is not None:
            return
        wanted = max_records + self.prefetch
        kept = len(self._fetched)
        if 2 * kept > wanted:
            return
        if self._top_up_executor is None:
            self._top_up_executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="atomlog-receive")
        self._top_up_call = self._top_up_executor.submit(self._receive_now, wanted - kept)

    def _receive_now(self, count: int) -> tuple[Fetched, float, float]:
        """One Receive of up to `count` messages that does not wait at the servers (the
        background top-up's): what it delivered, and when it was sent. A server that
        fails is left out (its error comes back from the poll that calls it next)."""
        servers = self._by_server(self.partitions)
        began, began_wall = time.monotonic(), time.time()
        _, _, results = self._call_once(
            "Receive", self._receive_request(0, count // max(1, len(servers))),
            self._receive_order(), self.request_timeout_s)
        return self._delivered(results), began, began_wall

    def _receive_order(self) -> list[tuple[str, int]]:
        """The partitions, starting one further at each Receive. A server takes a
        Receive's messages partition by partition in request order until max_messages is
        reached: in the same order every time, a partition with a steady backlog starved
        the ones after it (one message behind 1,000 came on the 101st Receive)."""
        parts = self.partitions
        turn = self._receive_turns = self._receive_turns + 1
        k = turn % len(parts) if parts else 0
        return parts[k:] + parts[:k]

    def _receive_request(self, wait_ms: int, share: int):
        """build(group) of a ReceiveRequest for a server's partitions: at most `share`
        messages (1 to the field's limit), waiting up to wait_ms at the server."""
        share = min(max(1, share), MAX_MESSAGES_PER_RECEIVE)
        return lambda group: partition_pb2.ReceiveRequest(
            consumer_id=self.consumer_id,
            subscription_partitions=[self._sp(t, p) for t, p in group],
            isolation_level=ISOLATION[self.isolation], max_wait_ms=wait_ms,
            max_bytes=self.max_bytes_per_request, ack_timeout_ms=self.ack_timeout_ms,
            max_messages=share)

    def _take_top_up(self) -> None:
        """The background Receive's messages (waiting for it if it is still out) into the
        empty buffer, unless their ack timeout passed meanwhile (the server redelivers
        them)."""
        answer = self._settle_top_up()
        if answer is None:
            return
        delivered, began, began_wall = answer
        if delivered and time.monotonic() < began + self.ack_timeout_ms / 1000:
            self._fetched = delivered
            self._buffer_expires = began + self.ack_timeout_ms / 1000
            self.received_at = began_wall

    def _settle_top_up(self) -> tuple[Fetched, float, float] | None:
        """Wait for the background Receive, if one is out, and return its answer (None
        if none, or if it failed: it delivered nothing known, and the poll's own Receive
        follows and raises what fails for good). Before a close its answer is dropped:
        what it delivered is then released with the rest, not left out to this consumer
        until its ack timeout; a reset drops its reset partitions' part."""
        call, self._top_up_call = self._top_up_call, None
        if call is None:
            return None
        try:
            return call.result()
        except Exception:  # noqa: BLE001 — called again, and raised, by the poll's Receive
            return None

    def _receive(self, timeout_s: float, max_records: int) -> None:
        """Receive at most max_records messages into the buffer (see poll)."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            servers = self._by_server(self.partitions)
            began, began_wall = time.monotonic(), time.time()
            remaining = max(0.0, deadline - began)
            wait_ms = int(remaining * 1000) if len(servers) == 1 else 0
            # The servers are called at once, so each gets a share of max_records (and
            # of the prefetch): at most max(max_records + prefetch, servers) messages
            # come back in all.
            retry, last, results = self._call_once(
                "Receive", self._receive_request(
                    wait_ms, (max_records + self.prefetch) // max(1, len(servers))),
                self._receive_order(), self.request_timeout_s + remaining)
            delivered = self._delivered(results)
            failure = next((errors.error_for(r.error.reason, r.error.message,
                                             dict(r.error.metadata))
                            for r in results if r.error.reason), None)
            if failure is None and last is not None and not last.retriable:
                failure = last
            if delivered:  # their ack timeout started at the server after `began`
                self._fetched = delivered
                self._buffer_expires = began + self.ack_timeout_ms / 1000
                self.received_at = began_wall
            if failure is not None:
                raise failure  # the messages stay for the next poll
            if delivered:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if retry and last is not None:
                    raise last
                return
            attempt = attempt + 1 if retry else 0
            pause = self.backoff.delay(attempt) if retry else 0.05
            if retry or len(servers) > 1:
                time.sleep(min(remaining, pause))

    @staticmethod
    def _delivered(results) -> Fetched:
        """The delivered ranges of each result's batches, as blocks."""
        fetched = Fetched()
        for result in results:
            if result.error.reason:
                continue
            sp = result.subscription_partition
            wanted = sorted((r.start_offset, r.end_offset) for r in result.delivered_ranges)
            data = memoryview(result.record_batches)
            for start, header in iter_batches(data):
                if header.is_control:
                    continue
                batch = data[start:start + header.size]
                for first, end in wanted:
                    if first < header.next_offset and end > header.base_offset:
                        fetched.add(block_of(sp.topic, sp.partition, batch, header, first, end))
        return fetched

    # ------------------------------------------------------------------ acks
    def ack(self, messages, txn=None) -> None:
        """Acknowledge one message, a list, or the rows of a poll_arrow() table (one call
        per server, the servers at once), durably; with txn, pending until the
        transaction ends. Raises at once (and sends nothing) if `txn` is committing or
        ended."""
        if txn is not None:
            txn._check_accepting()
        self._ack(_individual(messages), txn)

    def ack_cumulative(self, message: Message, txn=None) -> None:
        """Acknowledge every message of the partition up to and including `message`."""
        if txn is not None:
            txn._check_accepting()
        self._ack(_cumulative(message), txn)

    def ack_async(self, messages, txn=None) -> concurrent.futures.Future:
        """ack() on the consumer's ack thread: returns a future at once, whose result()
        is None once the ack is durable (pending in `txn`) or raises what ack() would
        have raised. A transaction tracks the future: its commit() waits for it, and
        aborts and raises the ack's error if it failed. Raises at once (and sends
        nothing) if `txn` is committing or ended."""
        return self._ack_later(_individual(messages), txn)

    def ack_cumulative_async(self, message: Message, txn=None) -> concurrent.futures.Future:
        """ack_cumulative() on the consumer's ack thread; see ack_async()."""
        return self._ack_later(_cumulative(message), txn)

    def _ack_later(self, acks: dict, txn) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("consumer is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not acks:
            future.set_result(None)
            return future
        self._async_slots.acquire()  # at most max_async_acks unanswered
        try:
            if txn is not None:
                txn.track(future)  # raises if the transaction takes no more acks
            with self._async_lock:
                if self._async_executor is None:
                    self._async_executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="atomlog-ack")
                self._async_executor.submit(self._run_ack, future, acks, txn)
        except BaseException as error:
            self._async_slots.release()
            if future.set_running_or_notify_cancel():
                future.set_exception(error)  # a transaction tracking it must not wait
            raise
        return future

    def _run_ack(self, future: concurrent.futures.Future, acks: dict, txn) -> None:
        try:
            if not future.set_running_or_notify_cancel():
                return  # cancelled by the caller before it ran: nothing sent
            try:
                self._ack(acks, txn)
            except BaseException as error:  # noqa: BLE001 — handed to the future
                future.set_exception(error)
            else:
                future.set_result(None)
        finally:
            self._async_slots.release()

    def _ack(self, acks: dict, txn) -> None:
        if not acks:
            return
        txn_id = None
        if txn is not None and txn.one_call:
            self._check_kept_conflicts(acks, txn)
            if txn.keep_acks(self, acks):
                self._kept_by.remember(txn)
                return  # kept for the transaction's one-call commit
        if txn is not None:
            txn.register_subscriptions([(t, p, self.subscription) for t, p in acks])
            txn_id = txn.txn_id
        results = self._call_all("Ack", lambda group: partition_pb2.AckRequest(items=[
            partition_pb2.AckItem(
                subscription_partition=self._sp(t, p), cumulative_end_offset=acks[(t, p)][0],
                individual_ranges=[partition_pb2.OffsetRange(start_offset=s, end_offset=e)
                                   for s, e in acks[(t, p)][1]],
                txn_id=txn_id) for t, p in group]), list(acks))
        self._raise(results)

    def nack(self, messages, delay_s: float = 0.0) -> None:
        """Redeliver these messages (to any consumer of the subscription) after delay_s."""
        items = [messages] if isinstance(messages, Message) else list(messages)
        by_partition: dict[tuple[str, int], list[int]] = {}
        for m in items:
            by_partition.setdefault((m.topic, m.partition), []).append(m.offset)
        self._nack({key: [(o, o + 1) for o in offsets] for key, offsets in by_partition.items()},
                   delay_s)

    def _nack(self, ranges: dict, delay_s: float) -> None:
        results = self._call_all("Nack", lambda group: partition_pb2.NackRequest(
            consumer_id=self.consumer_id, redelivery_delay_ms=int(delay_s * 1000),
            items=[partition_pb2.NackItem(
                subscription_partition=self._sp(t, p),
                ranges=[partition_pb2.OffsetRange(start_offset=s, end_offset=e)
                        for s, e in ranges[(t, p)]]) for t, p in group]), list(ranges))
        self._raise(results)

    def reset(self, to: str = "earliest", *, offset: int | None = None,
              timestamp_ms: int | None = None, partitions=None) -> dict[tuple[str, int], int]:
        """Move the subscription's cursors (a seek, for every consumer of it): `to` is
        "earliest", "latest", "offset" (with `offset`, clamped to what the partition
        holds) or "timestamp" (with `timestamp_ms`: the first message at or after it).
        Everything below the new position counts as acknowledged, everything from it on
        as not. `partitions` ((topic, partition) pairs) limits it; default: all of this
        consumer's: what the consumer keeps of the others (delivered, not yet polled)
        stays for the next polls. Returns each partition's new position. Raises
        TransactionConflict while acks of the subscription are pending in an open
        transaction."""
        position = subscription_position(to, offset, timestamp_ms)
        targets = list(self.partitions if partitions is None else partitions)
        self._kept_by.switch_all()  # acks kept by one-call transactions are pending too
        unknown = [tp for tp in targets if tp not in self.partitions]
        if unknown:
            raise ValueError(f"not partitions of this consumer: {unknown}")
        self._keep_others(targets)
        results = self._call_all(
            "ResetSubscription", lambda group: partition_pb2.ResetSubscriptionRequest(
                subscription_partitions=[self._sp(t, p) for t, p in group],
                position=position, offset=offset or 0,
                timestamp_unix_ms=timestamp_ms or 0), targets)
        self._raise(results)
        sp = [r.subscription_partition for r in results]
        return {(s.topic, s.partition): r.cumulative_end_offset for s, r in zip(sp, results)}

    def _keep_others(self, moving) -> None:
        """Before a reset of `moving`: forget what is kept of those partitions (delivered
        before the move, which the server forgets) and keep the rest, which stays out
        to this consumer: what the buffer holds, and what the background Receive, waited
        for, delivered (taken by the polls once the buffer is empty, as before)."""
        answer = self._settle_top_up()
        moving = set(moving)
        self._fetched.drop_partitions(moving)
        if answer is None:
            return
        answer[0].drop_partitions(moving)
        if answer[0]:
            self._top_up_call = concurrent.futures.Future()
            self._top_up_call.set_result(answer)

    def _check_kept_conflicts(self, acks: dict, txn) -> None:
        """TransactionConflict for acks that claim offsets another one-call transaction
        of this consumer keeps acks for (the server's rule, applied before anything is
        sent; conflicts with other consumers' transactions surface at commit())."""
        for other in self._kept_by.live():
            if other is txn:
                continue
            for (topic, partition), (cumulative, ranges) in acks.items():
                claimed = other.kept_claims(topic, partition, self.subscription)
                wanted = ([(0, cumulative)] if cumulative else []) + list(ranges)
                if any(s < e2 and s2 < e for s, e in wanted for s2, e2 in claimed):
                    raise errors.error_for(
                        "TRANSACTION_CONFLICT", f"offsets of {topic}-{partition} are pending "
                        f"in another open transaction of subscription {self.subscription!r}")

    def describe(self) -> list:
        """The server's SubscriptionCursor of every partition (acks kept by one-call
        transactions are sent first: they show as pending)."""
        self._kept_by.switch_all()
        results = self._call_all("DescribeSubscription",
                                 lambda group: partition_pb2.DescribeSubscriptionRequest(
                                     subscription_partitions=[self._sp(t, p) for t, p in group]))
        self._raise(results)
        return results

    def close(self) -> None:
        """Release what is out to this consumer (redelivered to others at once)."""
        if self._closed:
            return
        self._closed = True
        self._settle_top_up()
        self._fetched.clear()
        if self._top_up_executor is not None:
            self._top_up_executor.shutdown(wait=True)
            self._top_up_executor = None
        with self._async_lock:
            executor, self._async_executor = self._async_executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # acks begun with ack_async() are sent first
        try:
            self._nack({key: [] for key in self.partitions}, 0.0)
        except errors.AtomlogClientError:
            pass  # the ack timeout redelivers them anyway

    def __enter__(self) -> SubscriptionConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _individual(messages) -> dict:
    """Individual acks of one message, a list or a poll_arrow() table: per partition,
    (0, contiguous ranges)."""
    if isinstance(messages, pa.Table):
        return {key: (0, spans) for key, spans in _table_ranges(messages).items()}
    items = [messages] if isinstance(messages, Message) else list(messages)
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    # A poll's messages come in offset order per partition, mostly one partition after
    # another: one pass without a sort, which it falls back to at the first message that
    # is not past its partition's last range (out of order, or a repeat).
    for m in items:
        key = (m.topic, m.partition)
        spans = ranges.get(key)
        offset = m.offset
        if spans is None:
            ranges[key] = [(offset, offset + 1)]
        elif spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], offset + 1)
        elif spans[-1][1] < offset:
            spans.append((offset, offset + 1))
        else:
            break
    else:  # the partitions in the order the sort gives them
        return {key: (0, ranges[key]) for key in sorted(ranges)}
    ranges.clear()
    for m in sorted(items, key=lambda m: (m.topic, m.partition, m.offset)):
        spans = ranges.setdefault((m.topic, m.partition), [])
        if spans and spans[-1][1] == m.offset:
            spans[-1] = (spans[-1][0], m.offset + 1)
        else:
            spans.append((m.offset, m.offset + 1))
    return {key: (0, spans) for key, spans in ranges.items()}


def _table_ranges(table: pa.Table) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """The contiguous offset ranges of a poll_arrow() table's rows, per partition: Arrow
    kernels find where a run breaks, so Python sees one row per range, not per record."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return {}
    rows = table.select(["topic", "partition", "offset"]).sort_by(
        [("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")])
    topic, partition, offset = (rows.column(i).combine_chunks() for i in range(3))
    n = rows.num_rows
    same = pc.and_(pc.and_(pc.equal(topic.slice(1), topic.slice(0, n - 1)),
                           pc.equal(partition.slice(1), partition.slice(0, n - 1))),
                   pc.equal(offset.slice(1), pc.add(offset.slice(0, n - 1), 1)))
    starts = [0] + [i + 1 for i in pc.indices_nonzero(pc.invert(same)).to_pylist()]
    ends = starts[1:] + [n]
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for begin, end in zip(starts, ends):
        out.setdefault((topic[begin].as_py(), partition[begin].as_py()), []).append(
            (offset[begin].as_py(), offset[end - 1].as_py() + 1))
    return out


def _cumulative(message: Message) -> dict:
    """A cumulative ack up to and including `message`."""
    return {(message.topic, message.partition): (message.offset + 1, [])}
