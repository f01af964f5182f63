"""TC-log appends riding in the staging calls' queue (coordinator/staging.py, StageTxnRequest
.appends): when an append rides, and what a coordinator does with each shape of answer,
with a stand-in for the partition server's stub (the real servers' side:
tests/test_one_call.py, "ride with staging calls"). An append rides only while a staging
call to its server is in flight or parts wait for one, and then shares the next call
with the parts queued beside it; a server that answers no `appends` (one from before the
field), or refuses a call of appends alone, gets them by Produce (and none for a while);
a call that did not reach its server, or did not come back in time, fails its appends
with it, with no Produce."""

from __future__ import annotations

import asyncio

import pytest

from atomlog.v1 import common_pb2, partition_pb2
from coordinator.records import TxnId
from coordinator.staging import NO_APPENDS_S, StageChannel
from coordinator.txn_log import TOPIC
from services.errors import AtomlogError

ADDRESS = "ps-0:1"


class Server:
    """A stand-in for one partition server's StageTxn (its stub and its routes): answers
    each call with `answer(request)` (a response, or an exception to raise); with
    `release`, the first call waits for that event first."""

    def __init__(self, answer, release: asyncio.Event | None = None):
        self.answer = answer
        self.release = release
        self.calls: list[partition_pb2.StageTxnRequest] = []

    async def owner(self, topic: str, partition: int) -> str:
        return ADDRESS

    def stub(self, address: str):
        return self

    async def refresh(self, force: bool = False) -> None:
        pass

    async def StageTxn(self, request, timeout):  # noqa: N802 — the stub's method
        self.calls.append(request)
        if self.release is not None and len(self.calls) == 1:
            await self.release.wait()
        answer = self.answer(request)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def append_item(offset: int) -> partition_pb2.ProduceItem:
    return partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=TOPIC, partition=offset),
        record_batch=b"batch-%d" % offset)


def appended(item: partition_pb2.ProduceItem, offset: int) -> partition_pb2.ProduceResult:
    return partition_pb2.ProduceResult(topic_partition=item.topic_partition,
                                       base_offset=offset, last_offset=offset)


def staged(request) -> list[partition_pb2.StageTxnResult]:
    return [partition_pb2.StageTxnResult(txn_id=item.txn_id, batch_results=[
        partition_pb2.ProduceResult(topic_partition=b.topic_partition, base_offset=7,
                                    last_offset=7) for b in item.batches])
        for item in request.items]


def channel_for(server: Server) -> tuple[StageChannel, list]:
    """A staging channel to `server`, and the Produce calls its appends went by."""
    channel = StageChannel(server)
    produced: list = []

    async def produce(address: str, items: list) -> list:
        produced.append((address, list(items)))
        return [appended(item, 100 + i) for i, item in enumerate(items)]
    channel.produce = produce
    return channel, produced


def stage_part(channel: StageChannel) -> asyncio.Task:
    batch = partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic="t", partition=0), record_batch=b"x")
    return asyncio.ensure_future(channel.stage(TxnId(1, 5), 3, [batch], [],
                                               asyncio.get_running_loop().time() + 10))


async def part_queued(channel: StageChannel, server: Server) -> asyncio.Task:
    """A transaction's part queued for ADDRESS (its staging call not sent yet)."""
    sent = len(server.calls)
    part = stage_part(channel)
    while not channel._calls.busy(ADDRESS):
        await asyncio.sleep(0)
    assert len(server.calls) == sent
    return part


def both(request):
    """A server's answer to parts and appends (the appends at offsets 40, 41, ...)."""
    return partition_pb2.StageTxnResponse(
        results=staged(request), appends=partition_pb2.ProduceResponse(
            results=[appended(item, 40 + i) for i, item in enumerate(request.appends.items)]))


def test_an_append_rides_only_while_its_server_has_staging_to_carry_it():
    async def scenario():
        server = Server(both)
        channel, produced = channel_for(server)
        assert not channel.takes_append(ADDRESS, append_item(1))  # nothing to ride with
        part = await part_queued(channel, server)
        assert channel.takes_append(ADDRESS, append_item(1))
        assert not channel.takes_append("ps-1:1", append_item(1))  # another server: idle
        await part
        await asyncio.sleep(0)  # the sender's last step
        assert not channel.takes_append(ADDRESS, append_item(1))
        await channel.close()
    asyncio.run(scenario())


def test_an_append_and_a_part_queued_together_leave_in_one_call_answered_each():
    server = Server(both)

    async def scenario():
        channel, produced = channel_for(server)
        part = await part_queued(channel, server)
        first, second = append_item(1), append_item(2)
        futures = [channel.submit_append(ADDRESS, first), channel.submit_append(ADDRESS, second)]
        results = await asyncio.gather(*futures)
        [staged_result] = await part
        assert [r.base_offset for r in results] == [40, 41]
        assert staged_result.base_offset == 7
        assert len(server.calls) == 1 and list(server.calls[0].appends.items) == [first, second]
        assert len(server.calls[0].items) == 1
        assert not produced
        await channel.close()
    asyncio.run(scenario())


def test_appends_a_server_does_not_answer_go_by_produce_and_no_more_ride_there_for_a_while():
    server = Server(lambda request: partition_pb2.StageTxnResponse(results=staged(request)))

    async def scenario():
        channel, produced = channel_for(server)
        part = await part_queued(channel, server)
        item = append_item(3)
        result = await channel.submit_append(ADDRESS, item)
        assert (await part)[0].base_offset == 7  # the part is answered as ever
        assert result.base_offset == 100 and produced == [(ADDRESS, [item])]
        await part_queued(channel, server)
        assert not channel.takes_append(ADDRESS, item)
        channel._no_appends[ADDRESS] -= NO_APPENDS_S  # the while is over
        assert channel.takes_append(ADDRESS, item)
        await channel.close()
    asyncio.run(scenario())


def in_turn(*answers):
    """A server answering its calls with `answers` in turn (each a function of the
    request), the first call held until `release` is set."""
    release = asyncio.Event()
    calls = iter(answers)
    return Server(lambda request: next(calls)(request), release), release


@pytest.mark.parametrize("reason", ["INVALID_ARGUMENT", "INTERNAL"])
def test_a_call_of_appends_alone_refused_whole_sends_them_by_produce(reason):
    """The append queued behind a staging call in flight leaves alone in the next call,
    which fails whole: refused by a server from before StageTxnRequest.appends (no
    items), or failing on them (INTERNAL: a fault of its own would meet every retry that
    rides again)."""
    server, release = in_turn(both, lambda request: AtomlogError(reason, "refused"))

    async def scenario():
        channel, produced = channel_for(server)
        part = await part_queued(channel, server)
        while not server.calls:  # the part's call is in flight
            await asyncio.sleep(0)
        item = append_item(4)
        assert channel.takes_append(ADDRESS, item)
        appending = channel.submit_append(ADDRESS, item)
        release.set()
        await part
        result = await appending
        assert len(server.calls) == 2 and not server.calls[1].items
        assert result.base_offset == 100 and produced == [(ADDRESS, [item])]
        assert ADDRESS in channel._no_appends
        await channel.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("reason", ["SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT", "SHUTTING_DOWN"])
def test_a_call_that_did_not_reach_its_server_fails_its_appends_with_it(reason):
    """The append's own retry (TxnLog.append, the same batch) goes on from it; a Produce
    to the same server now would meet the same. The part is staged again (staging's own
    retry)."""
    server, release = in_turn(lambda request: AtomlogError(reason, "the call failed"), both)

    async def scenario():
        channel, produced = channel_for(server)
        part = await part_queued(channel, server)
        appending = channel.submit_append(ADDRESS, append_item(5))
        release.set()
        with pytest.raises(AtomlogError) as failed:
            await appending
        assert failed.value.reason == reason and not produced
        assert (await part)[0].base_offset == 7
        assert ADDRESS not in channel._no_appends
        await channel.close()
    asyncio.run(scenario())


def test_large_appends_and_a_closed_channel_keep_to_produce():
    async def scenario():
        server = Server(both)
        channel, _ = channel_for(server)
        part = await part_queued(channel, server)
        big = partition_pb2.ProduceItem(topic_partition=append_item(0).topic_partition,
                                        record_batch=bytes(128 << 10))
        assert not channel.takes_append(ADDRESS, big)
        await part
        await channel.close()
        assert not channel.takes_append(ADDRESS, append_item(6))
    asyncio.run(scenario())
