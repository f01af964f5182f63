"""When a waiting Receive (long poll) wakes up: in-process, a real partition owner behind
the real PartitionServicer, whose passes over the subscription partitions
(`_receive_once`) are counted.

- A message whose ack timeout expires is redelivered at that deadline, not at the next
  tick of a poll interval; a long poll with nothing due makes one pass when it starts and
  one when it ends, also when the cursor's new deliveries are stopped at a limit (it
  used to spin on the data that was there but could not be delivered).
- New data, an abort releasing pending acks, a Nack (at once or after its delay), an ack
  freeing a cursor stopped at max_unacked_offsets, and a delivery with an earlier
  deadline wake it.

Bounds are generous (other jobs share the 2 cores): a redelivery must come after its
deadline and long before the long poll would have ended on its own.
"""

from __future__ import annotations

import asyncio
import threading
import time

from atomlog.v1 import common_pb2, partition_pb2
from partition_server.cursor_store import CursorStoreLimits
from partition_server.log import LogConfig
from partition_server.owner import Marker, OwnerSettings, PartitionOwner
from partition_server.record_batch import ControlType, Record, TxnId, encode_batch, parse_header
from partition_server.service import PartitionServicer
from partition_server.subscription_cursor import CursorLimits
from partition_server.subscriptions import PartitionSubscriptions

SP = common_pb2.SubscriptionPartition(topic="t", partition=0, subscription="s")
LONG_MS = 60_000  # an ack timeout / long poll that never ends within a test


class _Manager:
    server_name = "in-process"

    def __init__(self, owner: PartitionOwner) -> None:
        self._owner = owner

    def owner(self, topic: str, partition: int) -> PartitionOwner:
        assert (topic, partition) == (self._owner.topic, self._owner.partition)
        return self._owner


class _Context:
    def cancelled(self) -> bool:
        return False


class Harness:
    """One partition t-0 with subscription s (earliest), served in-process."""

    def __init__(self, owner: PartitionOwner) -> None:
        self.owner = owner
        self.servicer = PartitionServicer(_Manager(owner), None, max_batch_bytes=1 << 20,
                                          fetch_max_wait_ms=LONG_MS,
                                          fetch_default_max_bytes=1 << 20,
                                          max_message_bytes=8 << 20)
        self.passes = 0
        passes_of = self.servicer._receive_once

        async def counted(*args):
            self.passes += 1
            return await passes_of(*args)

        self.servicer._receive_once = counted

    async def produce(self, count: int) -> None:
        data = encode_batch([Record(b"k", b"v")] * count, timestamp_ms=1_000)
        [appended] = await self.owner.produce([(data, parse_header(data))])
        assert not isinstance(appended, Exception), appended

    async def receive(self, consumer: str, max_wait_ms: int = 0,
                      ack_timeout_ms: int = LONG_MS) -> tuple[list, list]:
        """(delivered ranges, redelivered ranges) as (start, end) pairs."""
        response = await self.servicer.Receive(partition_pb2.ReceiveRequest(
            consumer_id=consumer, subscription_partitions=[SP], max_wait_ms=max_wait_ms,
            ack_timeout_ms=ack_timeout_ms,
            isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED), _Context())
        [result] = response.results
        assert not result.error.reason, result.error
        return ([(r.start_offset, r.end_offset) for r in result.delivered_ranges],
                [(r.start_offset, r.end_offset) for r in result.redelivered_ranges])

    async def ack(self, start: int, end: int) -> None:
        response = await self.servicer.Ack(partition_pb2.AckRequest(items=[
            partition_pb2.AckItem(subscription_partition=SP, individual_ranges=[
                partition_pb2.OffsetRange(start_offset=start, end_offset=end)])]), _Context())
        assert not response.results[0].error.reason, response.results[0].error

    async def nack(self, consumer: str, delay_ms: int) -> None:
        response = await self.servicer.Nack(partition_pb2.NackRequest(
            consumer_id=consumer, redelivery_delay_ms=delay_ms,
            items=[partition_pb2.NackItem(subscription_partition=SP)]), _Context())
        assert not response.results[0].error.reason, response.results[0].error


def run(tmp_path, scenario, cursor_limits: CursorLimits | None = None) -> None:
    settings = OwnerSettings(log=LogConfig(), fsync=False, cursor_limits=CursorStoreLimits(
        cursor=cursor_limits or CursorLimits()))

    async def main():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            harness = Harness(owner)
            response = await harness.servicer.CreateSubscription(
                partition_pb2.CreateSubscriptionRequest(
                    subscription_partitions=[SP],
                    initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST),
                _Context())
            assert response.results[0].created
            await scenario(harness)
        finally:
            await owner.close()

    asyncio.run(main())


def test_a_message_is_redelivered_at_its_ack_timeout(tmp_path):
    ack_timeout_s = 1.5

    async def scenario(h: Harness) -> None:
        await h.produce(3)
        delivered_at = time.monotonic()
        assert await h.receive("a", ack_timeout_ms=int(ack_timeout_s * 1000)) == ([(0, 3)], [])
        h.passes = 0
        began = time.monotonic()
        delivered, redelivered = await h.receive("b", max_wait_ms=LONG_MS)
        returned = time.monotonic()
        assert delivered == redelivered == [(0, 3)]
        assert returned - delivered_at >= ack_timeout_s - 0.05  # not before the deadline
        assert returned - began < ack_timeout_s + 10  # noticed, not the long poll's end
        # One pass at the start, one at the deadline (a timer firing a hair early may
        # cost one more); a 0.5 s poll would have made four.
        assert h.passes <= 3, h.passes

    run(tmp_path, scenario)


def test_a_long_poll_with_nothing_due_does_not_spin(tmp_path):
    wait_ms = 2_500

    async def scenario(h: Harness) -> None:
        await h.produce(3)
        assert await h.receive("a") == ([(0, 3)], [])  # out to a for a minute
        h.passes = 0
        began = time.monotonic()
        assert await h.receive("b", max_wait_ms=wait_ms) == ([], [])
        assert time.monotonic() - began >= wait_ms / 1000 - 0.05
        assert h.passes <= 3, h.passes  # start and end; a 0.5 s poll made six

    run(tmp_path, scenario)


def test_a_cursor_stopped_at_a_limit_waits_for_an_ack_without_spinning(tmp_path):
    async def scenario(h: Harness) -> None:
        await h.produce(5)
        assert await h.receive("a") == ([(0, 2)], [])  # max_unacked_offsets: 2
        # Offsets 2..4 are there but may not be delivered: waiting on the data would spin.
        h.passes = 0
        assert await h.receive("b", max_wait_ms=2_000) == ([], [])
        assert h.passes <= 3, h.passes
        waiting = asyncio.create_task(h.receive("b", max_wait_ms=LONG_MS))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        began = time.monotonic()
        await h.ack(0, 2)  # room again: the waiting Receive takes the next two at once
        assert await asyncio.wait_for(waiting, 20) == ([(2, 4)], [])
        assert time.monotonic() - began < 10

    run(tmp_path, scenario, CursorLimits(max_unacked_offsets=2))


def test_new_data_an_abort_and_a_nack_wake_a_waiting_receive(tmp_path):
    async def waits_then(h: Harness, change) -> tuple[list, list, float]:
        waiting = asyncio.create_task(h.receive("b", max_wait_ms=LONG_MS))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        began = time.monotonic()
        await change()
        delivered, redelivered = await asyncio.wait_for(waiting, 20)
        return delivered, redelivered, time.monotonic() - began

    async def scenario(h: Harness) -> None:
        subscriptions = h.owner.subscriptions
        # New data.
        delivered, _, elapsed = await waits_then(h, lambda: h.produce(3))
        assert delivered == [(0, 3)] and elapsed < 10
        await h.ack(0, 3)
        # An abort releases a pending ack: redeliverable at once.
        await h.produce(3)
        assert await h.receive("a") == ([(3, 6)], [])
        txn = TxnId(1, 7)
        await subscriptions.ack("s", 0, [(3, 6)], txn, h.owner.max_read_position())
        delivered, redelivered, elapsed = await waits_then(
            h, lambda: subscriptions.end_txn("s", txn, committed=False))
        assert delivered == redelivered == [(3, 6)] and elapsed < 10
        # A Nack, at once.
        await h.nack("b", delay_ms=0)
        assert (await h.receive("a"))[0] == [(3, 6)]
        delivered, redelivered, elapsed = await waits_then(h, lambda: h.nack("a", 0))
        assert delivered == redelivered == [(3, 6)] and elapsed < 10
        # A Nack with a delay moves the earliest deadline from a minute to half a second:
        # one pass at the start, one on the Nack, one at the end of the delay.
        h.passes = 0
        delivered, redelivered, elapsed = await waits_then(h, lambda: h.nack("b", 500))
        assert delivered == redelivered == [(3, 6)]
        assert 0.45 <= elapsed < 10 and h.passes <= 4, (elapsed, h.passes)

    run(tmp_path, scenario)


def test_a_delivery_with_an_earlier_deadline_wakes_long_polls(tmp_path):
    async def scenario(h: Harness) -> None:
        subscriptions = h.owner.subscriptions

        async def woken(mark: int) -> bool:
            waiter = subscriptions.wait_for_wakeup("s", mark, LONG_MS / 1000)
            try:
                await asyncio.wait_for(waiter, 10)
            except asyncio.TimeoutError:
                return False
            return True

        await h.produce(2)
        mark = subscriptions.wakeup_mark()
        await h.receive("a")  # nothing was out: a first deadline
        assert await woken(mark)
        await h.produce(2)
        mark = subscriptions.wakeup_mark()
        await h.receive("c", ack_timeout_ms=1_000)  # earlier than a's
        assert await woken(mark)

    run(tmp_path, scenario)


def test_a_reopen_after_a_failure_that_ends_after_a_close_does_not_leak_its_store(tmp_path):
    """The store fails and is being reopened on a worker thread when the owner closes the
    subscriptions and opens them again: the late reopen closes what it opened instead of
    replacing (and leaking) the owner's store."""
    async def scenario():
        subscriptions = PartitionSubscriptions("t-0", tmp_path / "cursors", CursorStoreLimits(),
                                               lambda: 0)
        await asyncio.to_thread(subscriptions.open, 0)
        await subscriptions.create("s", 0)
        failed = subscriptions.store
        release, late = threading.Event(), []
        open_store = subscriptions._open_store

        def slow_open(log_start: int):
            release.wait(10)
            late.append(open_store(log_start))
            return late[-1]

        subscriptions._open_store = slow_open
        recovering = asyncio.ensure_future(subscriptions._recover(failed, OSError("disk gone")))
        await asyncio.sleep(0.05)
        assert subscriptions.store is None  # closed, reopening
        subscriptions.close()  # the owner reloads the partition meanwhile
        subscriptions._open_store = open_store
        await asyncio.to_thread(subscriptions.open, 0)
        owners = subscriptions.store
        release.set()
        failure = await recovering
        assert failure.reason == "PARTITION_LOADING"
        assert subscriptions.store is owners and not owners.closed
        (reopened, error, _), = late
        assert error is None and reopened is not owners and reopened.closed
        assert "s" in owners.cursors()
        subscriptions.close()
        assert owners.closed

    asyncio.run(scenario())


def test_a_receive_reads_only_as_much_of_the_log_as_it_can_deliver(tmp_path):
    """A poll of a few messages from a long backlog reads about the batches it delivers,
    not max_bytes of the log (every read is CRC-checked): it used to read up to max_bytes
    (8 MiB from the SDK) for each poll of 100. What is delivered is unchanged: holes
    first, then new offsets, lowest first, at most max_messages."""
    async def scenario(h: Harness) -> None:
        for _ in range(40):  # 2,000 offsets in batches of 50 records of 2 KiB
            data = encode_batch([Record(b"k", bytes(2048))] * 50, timestamp_ms=1_000)
            [appended] = await h.owner.produce([(data, parse_header(data))])
            assert not isinstance(appended, Exception), appended
        read_bytes: list[int] = []
        read = h.owner.read

        def counted(offset, max_bytes, **kwargs):
            answer = read(offset, max_bytes, **kwargs)
            read_bytes.append(len(answer[0]))
            return answer

        h.owner.read = counted

        async def take(consumer: str, count: int, ack_timeout_ms: int = LONG_MS):
            read_bytes.clear()
            response = await h.servicer.Receive(partition_pb2.ReceiveRequest(
                consumer_id=consumer, subscription_partitions=[SP], max_messages=count,
                ack_timeout_ms=ack_timeout_ms, max_bytes=8 << 20,
                isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED), _Context())
            [result] = response.results
            assert not result.error.reason, result.error
            return ([(r.start_offset, r.end_offset) for r in result.delivered_ranges],
                    [(r.start_offset, r.end_offset) for r in result.redelivered_ranges])

        batch_bytes = len(data)
        assert await take("a", 120, ack_timeout_ms=1_000) == ([(0, 120)], [])
        assert sum(read_bytes) <= 3 * batch_bytes, read_bytes  # the 3 batches it touches
        assert await take("a", 100) == ([(120, 220)], [])
        assert sum(read_bytes) <= 3 * batch_bytes, read_bytes
        # After their ack timeout the first 120 are a hole, delivered before anything new.
        await asyncio.sleep(1.2)
        assert await take("b", 150) == ([(0, 120), (220, 250)], [(0, 120)])
        assert sum(read_bytes) <= 5 * batch_bytes, read_bytes
        # A large poll still takes the whole backlog in one pass.
        assert await take("c", 5_000) == ([(250, 2_000)], [])
        assert sum(read_bytes) == 35 * batch_bytes and len(read_bytes) <= 3, read_bytes

    run(tmp_path, scenario)


def test_a_receive_over_a_long_run_of_aborted_data_reads_a_bounded_amount_each_pass(
        tmp_path):
    """Under read_committed a read over aborted data keeps nothing but moves on; it was
    charged 1 byte of the pass's budget, so one Receive scanned a whole aborted run in a
    single step of the event loop (10,001 reads for 10 M aborted offsets, every partition
    of the server stalled meanwhile). A read that keeps nothing now costs what it asked
    for; what it passed is skipped at once (a skip entry), so later passes go on from
    there and the message behind the run is reached."""
    subs = PartitionSubscriptions("t-0", tmp_path / "cursors", CursorStoreLimits(), lambda: 0)
    subs.open(0)
    store = subs.store
    store.stage(store.plan_create("s", 0))
    store.sync()
    end = 1_000_000
    message = encode_batch([Record(b"k", b"v")], timestamp_ms=1)
    reads = [0]

    def read(offset, max_bytes):
        reads[0] += 1
        if offset < end:
            return b"", min(offset + 1_000, end)  # aborted: filtered out, 1,000 a read
        from partition_server.record_batch import PREFIX, PREFIX_SIZE
        header = parse_header(message)
        return PREFIX.pack(end, header.batch_length, header.magic, 5) + \
            message[PREFIX_SIZE:], end + 1

    try:
        passes = 0
        while True:
            passes += 1
            reads[0] = 0
            _, delivery = subs.receive("s", "c", read, end + 1, 1_000, 30_000,
                                       max_bytes=1 << 20, max_offsets=100)
            assert reads[0] <= 1 + (1 << 20) // (64 << 10), reads[0]
            if delivery.delivered:
                break
            assert passes < 1_000
        assert [tuple(r) for r in delivery.delivered] == [(end, end + 1)]
    finally:
        subs.close()


def test_a_subscription_made_at_latest_gets_what_an_open_transaction_commits_after_it(
        tmp_path):
    """"latest" was the high watermark: a transaction open below it (its data at 3-5)
    that committed after the subscription was made counted as acknowledged and was never
    delivered. It is now the max read position, as Kafka's read_committed "latest" is the
    last stable offset."""
    async def scenario(h: Harness) -> None:
        await h.produce(3)
        txn = TxnId(1, 7)
        data = encode_batch([Record(b"k", b"t")] * 3, timestamp_ms=1_000, txn=txn)
        await h.owner.stage(txn, data, parse_header(data), coordinator_epoch=1)
        assert h.owner.log.high_watermark == 6 and h.owner.max_read_position() == 3
        late = common_pb2.SubscriptionPartition(topic="t", partition=0, subscription="late")
        response = await h.servicer.CreateSubscription(partition_pb2.CreateSubscriptionRequest(
            subscription_partitions=[late],
            initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_LATEST), _Context())
        assert response.results[0].cumulative_end_offset == 3
        [done] = await h.owner.end_transactions([Marker(txn, ControlType.COMMIT, 1)])
        assert not isinstance(done, Exception), done
        response = await h.servicer.Receive(partition_pb2.ReceiveRequest(
            consumer_id="c", subscription_partitions=[late], ack_timeout_ms=LONG_MS,
            isolation_level=common_pb2.ISOLATION_LEVEL_READ_COMMITTED), _Context())
        [result] = response.results
        assert [(r.start_offset, r.end_offset) for r in result.delivered_ranges] == [(3, 6)]

    run(tmp_path, scenario)


def test_a_store_reopened_while_the_log_start_moved_forgets_below_the_new_start(tmp_path):
    """After a journal failure the store reopens on a worker thread; retention (or
    DeleteRecords) moving the log start meanwhile found no store to tell, so the cursors
    came back below the new start and every Receive read OFFSET_OUT_OF_RANGE (fatal in
    the SDK) until the start moved again."""
    start = [0]
    subs = PartitionSubscriptions("t-0", tmp_path / "cursors", CursorStoreLimits(),
                                  lambda: start[0])
    subs.open(0)
    subs.store.stage(subs.store.plan_create("s", 0))
    subs.store.sync()
    opened = subs._open_store

    def open_while_retention_runs(log_start, log_end=None):
        answer = opened(log_start, log_end)
        start[0] = 10  # retention moved the start while this ran
        subs.forget_below(10)  # (no store installed yet: nothing to tell)
        return answer

    async def scenario():
        subs.store.close()
        subs.store = None
        subs._open_store = open_while_retention_runs
        await subs._reopen(subs._generation)
        assert subs.store.cursor("s").cumulative_end == 10

    try:
        asyncio.run(scenario())
    finally:
        subs.close()


def test_an_ack_timeout_asked_below_the_floor_is_raised_to_it(tmp_path):
    """A Receive could ask for a 1 ms ack timeout: its message bounced between consumers
    every few milliseconds, each delivery waking every long poll. At least 100 ms now."""
    async def scenario(h: Harness) -> None:
        await h.produce(1)
        assert await h.receive("a", ack_timeout_ms=1) == ([(0, 1)], [])
        await asyncio.sleep(0.03)
        assert await h.receive("b") == ([], [])  # still a's
        await asyncio.sleep(0.1)
        assert await h.receive("b") == ([(0, 1)], [(0, 1)])

    run(tmp_path, scenario)


def test_a_marker_s_subscription_change_is_staged_in_the_caller_s_step(tmp_path):
    """The subscription markers of an EndTxnOnPartition or a staging call's riders
    (PartitionServicer._apply_subscription_markers) are staged in the step that calls
    it, not once the partitions' markers are durable: an ack staged after them in the
    same turn (a staging call's own acks) shares their durability round."""
    async def scenario(h: Harness) -> None:
        subscriptions = h.owner.subscriptions
        await h.produce(6)
        assert await h.receive("a") == ([(0, 6)], [])
        first, second = TxnId(1, 7), TxnId(1, 8)
        await subscriptions.ack("s", 0, [(0, 3)], first, h.owner.max_read_position())
        rounds = []
        sync_once = subscriptions._sync_once
        subscriptions._sync_once = lambda store: (rounds.append(store), sync_once(store))[1]
        staged = subscriptions.store.appended_end
        marker = partition_pb2.TxnMarker(
            txn_id=common_pb2.TxnId(tc_partition=1, sequence=7),
            decision=partition_pb2.TXN_DECISION_COMMIT, coordinator_epoch=0,
            subscription_partitions=[SP])
        applied = PartitionServicer._apply_subscription_markers([marker], [None],
                                                                {("t", 0): h.owner})
        assert subscriptions.store.appended_end == staged + 1  # before anything awaited
        acked = asyncio.ensure_future(subscriptions.ack(
            "s", 0, [(3, 6)], second, h.owner.max_read_position()))
        assert await applied == {(0, 0): False}
        await acked
        assert len(rounds) == 1  # the marker and the later ack: one durability round
        assert subscriptions.cumulative_end("s") == 3  # first's acks applied
        assert subscriptions.pending_transactions("s") == [second]

    run(tmp_path, scenario)


def test_records_a_receive_delivers_count_as_records_out(tmp_path):
    """atomlog_partition_records_out_total counted Fetch only, while bytes_out counted
    Receive too: a topic read only through subscriptions showed about 0 records out on
    the Overview dashboard. Delivered records (redeliveries too) count now."""
    from prometheus_client import REGISTRY

    def records_out() -> float:
        return REGISTRY.get_sample_value("atomlog_partition_records_out_total",
                                         {"topic": "t"}) or 0.0

    async def scenario(h: Harness) -> None:
        before = records_out()
        await h.produce(3)
        assert await h.receive("a", ack_timeout_ms=100) == ([(0, 3)], [])
        assert records_out() == before + 3
        await asyncio.sleep(0.15)
        assert await h.receive("b") == ([(0, 3)], [(0, 3)])  # redelivered
        assert records_out() == before + 6

    run(tmp_path, scenario)


def test_a_wall_clock_stepped_back_does_not_hold_redeliveries(tmp_path, monkeypatch):
    """Delivery deadlines (ack timeouts, Nack delays) live in the server's memory only,
    but were wall-clock times: a clock stepped back an hour (an NTP step, a resumed VM)
    held a dead consumer's messages, and with them the subscription's unacknowledged
    budget, for the hour. They count on the process's steady clock now."""
    real = time.time

    async def scenario(h: Harness) -> None:
        await h.produce(3)
        assert await h.receive("a", ack_timeout_ms=300) == ([(0, 3)], [])
        monkeypatch.setattr(time, "time", lambda: real() - 3_600)  # stepped back
        began = time.monotonic()
        delivered, redelivered = await h.receive("b", max_wait_ms=5_000)
        assert redelivered == [(0, 3)], (delivered, redelivered)
        assert time.monotonic() - began < 3

    run(tmp_path, scenario)


def test_a_nack_delay_past_the_ack_timeout_limit_is_refused(tmp_path):
    """redelivery_delay_ms had no bound: a wrong unit (or a Go client's negative delay,
    sent as about 49.7 days) held messages for weeks, and releasing the consumer did not
    free them. Past subscription.max_ack_timeout_ms it is refused, and nothing changes."""
    from services.errors import AtomlogError as Refused

    async def scenario(h: Harness) -> None:
        await h.produce(3)
        assert await h.receive("a") == ([(0, 3)], [])
        limit = h.servicer.subscription_settings.max_ack_timeout_ms
        try:
            await h.servicer.Nack(partition_pb2.NackRequest(
                consumer_id="a", redelivery_delay_ms=limit + 1,
                items=[partition_pb2.NackItem(subscription_partition=SP)]), _Context())
        except Refused as refused:
            assert refused.reason == "INVALID_ARGUMENT", refused
        else:
            raise AssertionError("a Nack delay past the limit was taken")
        await h.nack("a", 0)  # within it: taken, and the offsets are free at once
        assert await h.receive("b") == ([(0, 3)], [(0, 3)])

    run(tmp_path, scenario)
