"""Which lingering markers ride with a staging call (coordinator/markers.py take_riders),
and the request they make, as pure code: no server, no event loop."""

from __future__ import annotations

import asyncio

from coordinator.core import Marker
from coordinator.markers import MarkerChannel
from coordinator.records import Decision, TopicPartition, TxnId


def channel_with(lingering: list[Marker], batch_max: int = 10_000) -> MarkerChannel:
    channel = MarkerChannel(routes=None, batch_max=batch_max)
    sink = object()
    channel._lingering["ps-0"] = [(float(i), sink, m) for i, m in enumerate(lingering)]
    return channel


def marker(sequence: int, partition: int) -> Marker:
    return Marker(TxnId(0, sequence), Decision.COMMIT, 1, TopicPartition("t", partition))


def test_to_another_process_every_lingering_marker_rides_oldest_first_up_to_the_bound():
    markers = [marker(s, s % 3) for s in range(1, 8)]
    channel = channel_with(markers, batch_max=5)
    riders = channel.take_riders("ps-0")
    assert [m for _, m in riders] == markers[:5]
    assert [m for _, _, m in channel._lingering["ps-0"]] == markers[5:]
    assert [m for _, m in channel.take_riders("ps-0")] == markers[5:]
    assert channel.take_riders("ps-0") == [] and channel.take_riders("ps-1") == []


def test_in_process_only_markers_for_the_partitions_the_call_writes_ride():
    markers = [marker(s, s % 3) for s in range(1, 8)]
    channel = channel_with(markers, batch_max=2)
    riders = channel.take_riders("ps-0", {("t", 1)})
    assert [m for _, m in riders] == [markers[0], markers[3]]  # partition 1, at most 2
    assert [m for _, _, m in channel._lingering["ps-0"]] == \
        [m for m in markers if m not in (markers[0], markers[3])]


def test_the_riders_request_groups_a_transactions_targets_in_one_marker():
    sink = object()
    batch = [(sink, marker(1, 0)), (sink, marker(1, 2)), (sink, marker(2, 0))]
    request, (keys, grouped, sinks) = MarkerChannel.request_of(batch)
    assert [(m.txn_id.sequence, [tp.partition for tp in m.topic_partitions])
            for m in request.markers] == [(1, [0, 2]), (2, [0])]
    assert len(keys) == 2 and set(sinks) == {id(sink)}


class _Routes:
    def cached_owner(self, topic: str, partition: int) -> str:
        return "ps-0"


def test_markers_linger_only_while_staging_calls_to_their_server_are_frequent():
    """A lone client committing now and then must not wait linger_s for a ride that will
    not come: a marker lingers only when the last two staging calls to its server were
    at most linger_s apart."""
    async def run() -> None:
        channel = MarkerChannel(_Routes(), linger_s=0.020)
        sink = object()
        one_call = lambda txn_id: True  # noqa: E731
        channel.send(sink, [marker(1, 0)], may_linger=one_call)  # no staging seen yet
        assert channel._queues["ps-0"] == [(sink, marker(1, 0))]
        assert not channel._lingering["ps-0"]
        channel.staging_to("ps-0")
        channel.send(sink, [marker(2, 0)], may_linger=one_call)  # one call: no gap known
        channel.staging_to("ps-0")  # the next follows at once: traffic
        channel.send(sink, [marker(3, 0)], may_linger=one_call)
        channel.send(sink, [marker(4, 0)], may_linger=lambda txn_id: False)  # streaming
        assert [m for _, _, m in channel._lingering["ps-0"]] == [marker(3, 0)]
        assert [m for _, m in channel._queues["ps-0"]] == [marker(s, 0) for s in (1, 2, 4)]
        channel._staging_gaps["ps-0"] = 0.5  # the last two calls 0.5 s apart
        channel.send(sink, [marker(5, 0)], may_linger=one_call)
        assert [m for _, m in channel._queues["ps-0"]][-1] == marker(5, 0)
        await channel.close()

    asyncio.run(run())


def test_a_marker_sender_that_hits_an_error_goes_on_sending():
    """One sender task per server sends its markers, and nothing starts a second one. An
    error outside a delivery (here taking the lingering markers that are due) used to
    end it: every later marker to that server stayed unsent, and their transactions
    hung. Now it is logged and the sender goes on."""
    delivered = []

    async def run() -> None:
        channel = MarkerChannel(_Routes())
        failures = []
        take_due = channel._take_due

        def failing_once(address):
            if not failures:
                failures.append(address)
                raise RuntimeError("a defect in _take_due (test)")
            take_due(address)

        async def deliver(address, batch):
            delivered.extend(m for _, m in batch)

        channel._take_due, channel._deliver = failing_once, deliver
        sink = object()
        channel.send(sink, [marker(1, 0)])
        for _ in range(100):
            await asyncio.sleep(0.01)
            if delivered:
                break
        channel.send(sink, [marker(2, 0)])  # the same sender, woken again
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(delivered) == 2:
                break
        assert failures == ["ps-0"] and delivered == [marker(1, 0), marker(2, 0)]
        await channel.close()

    asyncio.run(run())


def test_markers_sent_again_while_their_server_does_not_answer_are_queued_once():
    """A TC partition sends every unconfirmed marker again each marker_retry_ms. While a
    partition server stays registered but does not answer, a call takes batch_max
    markers per request timeout; before, every re-send was appended again, and the
    queue grew by thousands a second without bound. Now a marker lingering or queued
    already is not queued again: at most once queued, once more in the call."""
    async def run() -> None:
        channel = MarkerChannel(_Routes(), batch_max=100, linger_s=0.0)
        calls: list[int] = []
        answer = asyncio.Event()

        async def deliver(address, batch):  # a server that does not answer (yet)
            calls.append(len(batch))
            await answer.wait()

        channel._deliver = deliver
        sink = object()
        unconfirmed = [marker(s, s % 3) for s in range(1, 301)]
        for _ in range(20):  # twenty rounds of re-sends of all 300
            channel.send(sink, unconfirmed)
            await asyncio.sleep(0)
        assert calls == [100]  # one call under way with the first 100
        assert channel.queued == 300  # the other 200, and the first 100 once more
        given = channel.take_riders("ps-0")  # (nothing lingers)
        assert given == []
        answer.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if channel.queued == 0:
                break
        assert channel.queued == 0 and sum(calls) == 400
        await channel.close()

    asyncio.run(run())


def test_riders_given_back_are_not_queued_twice():
    """A staging call took two lingering markers; one of them was sent again meanwhile
    (queued once more: it was on its way in the call); the call failed and gives both
    back. The re-sent one is queued once, not twice."""
    async def run() -> None:
        channel = MarkerChannel(_Routes(), linger_s=10.0)
        channel._wake = lambda address: None  # no sender: the queue is looked at as it is
        sink = object()
        channel.staging_to("ps-0")
        channel.staging_to("ps-0")  # frequent staging calls: one-call markers linger
        channel.send(sink, [marker(1, 0), marker(2, 0)], may_linger=lambda txn_id: True)
        riders = channel.take_riders("ps-0")
        assert [m for _, m in riders] == [marker(1, 0), marker(2, 0)]
        channel.send(sink, [marker(1, 0)])  # re-sent while the call carries it
        channel.send(sink, [marker(1, 0)])  # and again: queued already
        channel.give_back("ps-0", riders)  # the staging call failed
        assert [m for _, m in channel._queues["ps-0"]] == [marker(1, 0), marker(2, 0)]
        await channel.close()

    asyncio.run(run())


def test_markers_written_in_the_step_are_answered_there_only_when_every_owner_wrote():
    """partition_server.service.MarkersHere.settle_written (the commit lane's riders
    confirmed in their step): outcomes now when every owner wrote its markers in the
    gathering, the works' futures replaced by a done one (their flushes answer nothing);
    else None, and the answer comes once durable. Nothing pending: answered at once by
    `settle`, and settle_written leaves it."""
    from partition_server.record_batch import ControlType
    from partition_server.record_batch import TxnId as PartitionTxnId
    from partition_server.service import MarkersHere
    from partition_server.write_step import Marker as PartitionMarker
    from partition_server.write_step import MarkerResult, _MarkerWork
    from services.batching import WhenAllDone

    async def scenario():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.set_result(None)
        owners = (object(), object())
        items = [[(0, None)], [(1, None)]]

        def queued(results) -> tuple[MarkersHere, list]:
            works = []
            for index, owner in enumerate(owners):
                work = _MarkerWork([PartitionMarker(PartitionTxnId(0, index + 1),
                                                    ControlType.COMMIT, 1)],
                                   loop.create_future())
                work.results = list(results[index])
                works.append((items[index], work, owner))
            here = MarkersHere([(None, w.markers[0]) for _, w, _ in works], [None, None],
                               [(i, w.future) for i, w, _ in works], works,
                               loop.create_future())
            WhenAllDone([w.future for _, w, _ in works], here.settle)
            return here, [w for _, w, _ in works]

        written = [[MarkerResult(10, False)], [MarkerResult(-1, True)]]
        here, works = queued(written)
        assert here.settle_written({owners[0]: True, owners[1]: True}, done) == \
            written[0] + written[1]
        assert here.answer.result() == written[0] + written[1]
        assert all(work.future is done for work in works)
        # One owner did not write in the step: nothing now, the answer once durable.
        here, works = queued(written)
        assert here.settle_written({owners[0]: True, owners[1]: False}, done) is None
        assert not here.answer.done() and all(w.future is not done for w in works)
        for work in works:
            work.future.set_result(work.results)
        await asyncio.sleep(0)
        assert here.answer.result() == written[0] + written[1]
        # Nothing pending (every marker refused before queueing): `settle` answered.
        refused = MarkersHere([], ["stale"], [], [], loop.create_future())
        WhenAllDone([], refused.settle)
        assert refused.answer.done()
        assert refused.settle_written({}, done) is None

    asyncio.run(scenario())
