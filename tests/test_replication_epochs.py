"""Followers copy before the leader's fsync (docs/replication.md, "Writes"), so a leader
never goes on in an epoch whose tail it may have lost: in process, one leader's owner and
LeaderReplication with an fsync the test holds or fails, and a follower's Replicate calls
made by hand. No ZooKeeper: the leader's way of giving its epoch up is a stub.

- the records a follower gets before the leader's fsync are whole appended batches, and
  the high watermark (what is acknowledged and readable) still waits for the leader's own
  fsync and the in-sync follower's;
- a failed fsync: everything unanswered fails, nothing more is served or accepted in the
  epoch, the log is cut back to what was durable, and the leader gives the epoch up
  (epoch + 1 written) before anything else; a follower that copied the lost tail is then
  told to cut it by the next leadership's epochs;
- a flush that is durable and replicated but that the log cannot end (its recovery
  point): its requests fail, unacknowledged, and the leader gives the epoch up;
- a leadership that would resume an epoch its leader-epoch file holds (a restart within
  the ZooKeeper session) gives it up instead of serving.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from pathlib import Path

import pytest

from atomlog.v1 import partition_pb2
from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.partition_states import Versioned
from partition_server.record_batch import Record, encode_batch, iter_batches, parse_header
from partition_server import replica as replica_module
from partition_server.replica import LeaderReplication
from partition_server.replication import NOT_SYNCED, PartitionState
from services.errors import AtomlogError


class Fsyncs:
    """An fsync the test holds (`hold`) and makes fail (`failing`)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.failing = False
        self.calls = 0

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        assert self.gate.wait(20), "fsync held too long"
        if self.failing:
            raise OSError(errno.EIO, "fsync failed (test)")
        import os
        os.fsync(fd)


def request(fetch: int, last_epoch: int, epoch: int = 1) -> partition_pb2.ReplicateRequest:
    req = partition_pb2.ReplicateRequest(replica="b", leader_epoch=epoch, fetch_offset=fetch,
                                         last_fetched_epoch=last_epoch,
                                         cursor_sequence=0)  # (no cursor snapshot)
    req.topic_partition.topic = "t"
    return req


def batch(value: bytes):
    data = encode_batch([Record(b"k", value)])
    return data, parse_header(data)


async def leading(directory: Path, fsync, epoch: int = 1, resigned: list | None = None,
                  log_config: LogConfig | None = None):
    async def no_isr_writes(_known, isr, _joining):
        raise AssertionError(f"unexpected ISR write {isr}")

    async def resign(given_up: int, heir_only: bool = False) -> Versioned:
        resigned.append(given_up)
        return Versioned(PartitionState("b", given_up + 1, ("b",)), 7)

    known = Versioned(PartitionState("a", epoch, ("a", "b")), 0)
    replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 2, 10_000, 0, directory,
                                    no_isr_writes, lambda: {"a", "b"},
                                    resign=resign if resigned is not None else None)
    owner = PartitionOwner("t", 0, directory, OwnerSettings(log=log_config or LogConfig()),
                           fsync=fsync)
    owner.replication, replication.owner = replication, owner
    await owner.start()
    replication.start()
    return owner, replication


def fetch(offset: int, incarnation: int) -> partition_pb2.ReplicateRequest:
    """b's fetch from `offset`, by its process `incarnation`."""
    req = request(offset, -1 if offset == 0 else 1)
    req.replica_incarnation = incarnation
    return req


async def leading_alone(directory: Path, write_isr):
    """a leads t-0 (min.insync.replicas 1) with b out of the ISR; ISR writes by
    `write_isr`."""
    known = Versioned(PartitionState("a", 1, ("a",)), 0)
    replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 1, 10_000, 0,
                                    directory, write_isr, lambda: {"a", "b"})
    owner = PartitionOwner("t", 0, directory, OwnerSettings(log=LogConfig()))
    owner.replication, replication.owner = replication, owner
    await owner.start()
    replication.start()
    return owner, replication


async def wait_for(predicate, what: str, timeout_s: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def acknowledge_first(owner, replication, value: bytes) -> None:
    """Follower b opens the gate at 0, the leader writes one record, and b's next fetch
    (it holds it) acknowledges it: the high watermark is 1."""
    await replication.replicate(request(0, -1), 0)
    produced = asyncio.ensure_future(owner.produce([batch(value)]))
    await wait_for(lambda: replication.local_durable_end == 1, "the first fsync")
    await replication.replicate(request(1, 1), 0)  # b holds it: acknowledged
    await asyncio.wait_for(produced, 10)
    assert replication.high_watermark == 1


def test_followers_copy_whole_batches_before_the_leaders_fsync_and_acks_wait_for_both(
        tmp_path):
    fsyncs = Fsyncs()

    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", fsyncs)
        try:
            # The ISR (a, b) holds the leader's empty log: a follower at 0 opens the gate.
            await replication.replicate(request(0, -1), 0)
            fsyncs.hold()
            produced = asyncio.ensure_future(owner.produce([batch(b"one"), batch(b"two")]))
            await wait_for(lambda: fsyncs.calls == 1, "the leader's fsync to begin")
            answer = await replication.replicate(request(0, -1), 0)
            copied = [h for _, h in iter_batches(memoryview(answer.records), verify=True)]
            assert [(h.base_offset, h.record_count) for h in copied] == [(0, 1), (1, 1)]
            assert answer.log_end_offset == 2 and answer.high_watermark == 0
            # The follower holds both durably; the leader does not yet: nothing acknowledged.
            await replication.replicate(request(2, 1), 0)
            await asyncio.sleep(0.1)
            assert not produced.done()
            assert replication.high_watermark == 0 and owner.log.high_watermark == 0
            fsyncs.release()
            results = await asyncio.wait_for(produced, 10)
            assert [r.base_offset for r in results] == [0, 1]
            assert replication.high_watermark == 2 and owner.log.high_watermark == 2
        finally:
            fsyncs.release()
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_follower_restarted_at_a_leaders_moved_log_start_copies_from_there(tmp_path):
    """DeleteRecords moves the leader's log start past where its epoch began. A follower
    that lost its log (wiped, or below that start) restarts empty at the log start and
    asks from there with no epoch: it holds a prefix of the leader's log, so it gets the
    records from there, not a divergence telling it to cut below its own start (which it
    answered by restarting at the same start again, without end: chaos seed 2690)."""
    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", Fsyncs(),
                                           log_config=LogConfig(segment_bytes=200))
        try:
            await replication.replicate(request(0, -1), 0)
            for i in range(8):  # a segment every two batches
                produced = asyncio.ensure_future(owner.produce([batch(b"v%d" % i)]))
                await wait_for(lambda: owner.log.log_end_offset == i + 1, "the append")
                await replication.replicate(request(i + 1, 1), 0)
                await asyncio.wait_for(produced, 10)
            start = await owner.delete_records(5)
            assert 0 < start <= 5 and owner.log.log_start_offset == start
            with pytest.raises(AtomlogError) as below:
                await replication.replicate(request(0, -1), 0)
            assert below.value.reason == "OFFSET_OUT_OF_RANGE"
            answer = await replication.replicate(request(start, -1), 0)
            assert not answer.diverging
            copied = [h.base_offset for _, h in iter_batches(memoryview(answer.records))]
            assert copied == list(range(start, 8))
            assert [(e.epoch, e.start_offset) for e in answer.epochs] == [(1, start)]
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_follower_that_did_not_apply_the_leaders_log_start_hears_it_again(tmp_path,
                                                                             monkeypatch):
    """An answer built is not an answer applied (the call broke, ReplicateMany left it
    out, the copy failed). The leader remembered the log start as told, and once the
    partition was idle nothing carried it again: the follower kept the deleted segments
    (diverged replicas in a CI chaos run). A follower still reporting an older start
    hears it again START_RETELL_MS after, not sooner; one that applied it hears nothing;
    a restarted one (another incarnation) is told afresh."""
    monkeypatch.setattr(replica_module, "START_RETELL_MS", 200)

    def at(offset: int, log_start: int, incarnation: int = 1):
        req = request(offset, 1)
        req.log_start_offset, req.replica_incarnation = log_start, incarnation
        return req

    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", Fsyncs(),
                                           log_config=LogConfig(segment_bytes=200))
        try:
            await replication.replicate(fetch(0, 1), 0)
            for i in range(8):  # a segment every two batches
                produced = asyncio.ensure_future(owner.produce([batch(b"v%d" % i)]))
                await wait_for(lambda: owner.log.log_end_offset == i + 1, "the append")
                await replication.replicate(at(i + 1, 0), 0)
                await asyncio.wait_for(produced, 10)
            assert not replication.has_news(8, 0, "b")  # caught up, idle
            start = await owner.delete_records(5)
            assert start > 0
            assert replication.has_news(8, 0, "b")
            told = await replication.replicate(at(8, 0), 0)
            assert told.log_start_offset == start and not told.records
            # That answer never reached b: it asks the same again.
            replication.begin_replicate(at(8, 0))
            assert not replication.has_news(8, 0, "b")  # not at once: no busy loop
            await asyncio.sleep(0.25)
            assert replication.has_news(8, 0, "b")
            again = await replication.replicate(at(8, 0), 0)
            assert again.log_start_offset == start
            # b applies it: quiet from then on.
            replication.begin_replicate(at(8, start))
            await asyncio.sleep(0.25)
            assert not replication.has_news(8, 0, "b")
            # b restarts (wiped) and copies again from the start: told afresh.
            replication.begin_replicate(at(start, start, incarnation=2))
            assert replication.has_news(start, 0, "b")
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_failed_fsync_gives_the_epoch_up_and_the_copied_tail_is_cut_by_the_next_epoch(
        tmp_path):
    fsyncs = Fsyncs()
    directory = tmp_path / "t-0"
    resigned: list[int] = []

    async def first_leadership():
        owner, replication = await leading(directory, fsyncs, resigned=resigned)
        try:
            await acknowledge_first(owner, replication, b"durable")
            fsyncs.hold()
            fsyncs.failing = True
            produced = asyncio.ensure_future(owner.produce([batch(b"lost")]))
            await wait_for(lambda: fsyncs.calls == 2, "the second fsync to begin")
            answer = await replication.replicate(request(1, 1), 0)
            assert answer.records and answer.log_end_offset == 2  # b copies the doomed tail
            fsyncs.release()
            with pytest.raises(AtomlogError):
                outcome = await asyncio.wait_for(produced, 10)
                raise outcome[0] if isinstance(outcome[0], AtomlogError) else AssertionError(
                    f"a write whose fsync failed was acknowledged: {outcome}")
            # Nothing more in this epoch: clients and followers are refused ...
            with pytest.raises(AtomlogError) as refused:
                owner.check_serving()  # (reloading, or reloaded and given up)
            assert refused.value.reason in ("PARTITION_LOADING", "NOT_PARTITION_OWNER")
            with pytest.raises(AtomlogError) as refused:
                replication.check_writable()
            assert refused.value.reason == "NOT_PARTITION_OWNER"
            with pytest.raises(AtomlogError) as refused:
                await replication.replicate(request(2, 1), 0)
            assert refused.value.reason == "NOT_PARTITION_OWNER"
            # ... the log is cut back to what was durable, and the epoch is given up.
            fsyncs.failing = False
            await wait_for(lambda: replication.fenced is not None, "the epoch to be given up")
            assert resigned == [1]
            assert owner.log.log_end_offset == 1
            assert replication.high_watermark == 1
        finally:
            fsyncs.release()
            await replication.close()
            await owner.close()

    async def next_leadership():
        # The same replica leads again, in epoch 2 (no other in-sync replica was live).
        owner, replication = await leading(directory, fsyncs, epoch=2, resigned=[])
        try:
            assert replication.epochs.cache.entries[-1] == (2, 1)
            # b copied offset 1 in epoch 1, which this log lost: it is told to cut it.
            answer = await replication.replicate(request(2, 1, epoch=2), 0)
            assert answer.diverging and (answer.diverging_epoch,
                                         answer.diverging_end_offset) == (1, 1)
            await replication.replicate(request(1, 1, epoch=2), 0)
            assert replication.fenced is None and replication.failed is None
            produced = asyncio.ensure_future(owner.produce([batch(b"new")]))
            await wait_for(lambda: replication.local_durable_end == 2, "the fsync")
            await replication.replicate(request(2, 2, epoch=2), 0)
            assert (await asyncio.wait_for(produced, 10))[0].base_offset == 1
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(first_leadership())
    asyncio.run(next_leadership())


def test_a_replicated_flush_the_log_cannot_end_fails_its_requests_and_gives_the_epoch_up(
        tmp_path):
    """A write durable on the leader waits for the in-sync replicas; when they hold it,
    ending the flush fails (the log refuses it, as it would a recovery point it cannot
    write). Its requests fail instead of waiting for ever, nothing is acknowledged, the
    leader serves nothing more in this epoch and gives it up."""
    fsyncs = Fsyncs()
    resigned: list[int] = []

    def refuse_to_end(*_args, **_kwargs):
        raise OSError(errno.EIO, "the recovery point could not be written (test)")

    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", fsyncs, resigned=resigned)
        try:
            await acknowledge_first(owner, replication, b"one")
            assert owner.log.high_watermark == 1
            produced = asyncio.ensure_future(owner.produce([batch(b"two")]))
            await wait_for(lambda: replication.local_durable_end == 2, "the leader's fsync")
            await asyncio.sleep(0.05)
            assert not produced.done() and len(owner._replicating) == 1  # waits for b
            broken = owner.log
            broken.flush_end = refuse_to_end  # this log object only: a reload opens another
            await replication.replicate(request(2, 1), 0)  # b holds it: the flush may end
            with pytest.raises(AtomlogError) as refused:
                outcome = await asyncio.wait_for(produced, 10)
                raise outcome[0] if isinstance(outcome[0], AtomlogError) else AssertionError(
                    f"a write whose flush could not end was acknowledged: {outcome}")
            assert refused.value.reason in ("PARTITION_LOADING", "NOT_PARTITION_OWNER")
            assert broken.high_watermark == 1  # never moved past what was acknowledged
            with pytest.raises(AtomlogError) as refused:
                replication.check_writable()
            assert refused.value.reason == "NOT_PARTITION_OWNER"
            await wait_for(lambda: replication.fenced is not None, "the epoch to be given up")
            assert resigned == [1]
        finally:
            fsyncs.release()
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_leadership_never_resumes_an_epoch_it_led_before(tmp_path):
    fsyncs = Fsyncs()
    directory = tmp_path / "t-0"

    async def lead_epoch_1():
        owner, replication = await leading(directory, fsyncs)
        produced = asyncio.ensure_future(owner.produce([batch(b"x")]))
        await wait_for(lambda: replication.local_durable_end == 1, "the fsync")
        await replication.close()  # (unacknowledged: the follower never reported it)
        await owner.close()
        with pytest.raises(AtomlogError):
            await produced

    async def lead_epoch_1_again():
        resigned: list[int] = []
        owner, replication = await leading(directory, fsyncs, resigned=resigned)
        try:
            await wait_for(lambda: replication.fenced is not None, "the epoch to be given up")
            assert resigned == [1]
            assert replication.failed and "resume leader epoch 1" in replication.failed
            assert replication.epochs.cache.entries == [(1, 0)]  # nothing assigned again
            with pytest.raises(AtomlogError) as refused:
                owner.check_serving()
            assert refused.value.reason == "NOT_PARTITION_OWNER"
            with pytest.raises(AtomlogError) as refused:
                await replication.replicate(request(0, -1), 0)
            assert refused.value.reason == "NOT_PARTITION_OWNER"
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(lead_epoch_1())
    asyncio.run(lead_epoch_1_again())


def test_a_leadership_whose_epoch_file_was_unreadable_gives_its_epoch_up(tmp_path):
    """An unreadable leader-epoch file is set aside and read as empty, so the check above
    found no epoch led before: a leader restarted within its ZooKeeper session led epoch
    1 again from a log that may have lost records followers copied in it, and copies
    that differ at the same offsets in the same epoch could not be told apart. Not knowing
    is now taken as having led it."""
    fsyncs = Fsyncs()
    directory = tmp_path / "t-0"

    async def lead_epoch_1():
        owner, replication = await leading(directory, fsyncs)
        await replication.close()
        await owner.close()

    async def lead_epoch_1_again():
        resigned: list[int] = []
        owner, replication = await leading(directory, fsyncs, resigned=resigned)
        try:
            assert replication.epochs.set_aside is not None
            await wait_for(lambda: replication.fenced is not None, "the epoch to be given up")
            assert resigned == [1] and "unreadable" in replication.failed
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(lead_epoch_1())
    [epochs_file] = directory.glob("leader-epoch*")
    epochs_file.write_bytes(b"garbage")
    asyncio.run(lead_epoch_1_again())


def test_one_call_answers_many_partitions_only_with_news_within_its_bound(tmp_path):
    """ReplicateMany's leader side (`replicate_many`, docs/replication.md "One call per
    leader"): it waits while no partition has news and ends at the first append on any;
    partitions with nothing new are left out; the answer's bound lets the first partition
    (from a rotating start) through whole and leaves the rest to the next call; a request
    naming a newer epoch is refused for its partition only and fences nothing."""
    from partition_server.replica import replicate_many

    fsyncs = Fsyncs()

    async def scenario():
        first, first_leader = await leading(tmp_path / "one" / "t-0", fsyncs)
        second, second_leader = await leading(tmp_path / "two" / "t-0", fsyncs)
        leaders = [first_leader, second_leader]
        try:
            for leader in leaders:  # the ISR (a, b) holds each empty log: gates open
                await leader.replicate(request(0, -1), 0)
            loop = asyncio.get_running_loop()
            began = loop.time()
            waiting = asyncio.ensure_future(replicate_many(
                [(leader, request(0, -1)) for leader in leaders], 5.0, 8 << 20))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # nothing anywhere: a long poll
            produced = [asyncio.ensure_future(second.produce([batch(b"x" * 100)]))]
            results = await asyncio.wait_for(waiting, 5)
            assert loop.time() - began < 3
            assert results[0] is None  # nothing new there: left out
            assert results[1].log_end_offset == 1 and len(results[1].records) > 0
            produced.append(asyncio.ensure_future(first.produce([batch(b"y" * 100)])))
            await wait_for(lambda: first_leader.log_end == 1, "the first leader's append")
            # A bound of one byte: the partition where the answer begins goes whole, the
            # other waits for the next call; the start rotates.
            for rotation, whole in ((0, 0), (1, 1)):
                items = [(first_leader, request(0, -1)), (second_leader, request(0, -1))]
                results = await replicate_many(items, 0, 1, rotation)
                assert results[whole] is not None and len(results[whole].records) > 0
                assert results[1 - whole] is None, rotation
            # A newer epoch than the leadership's: refused for that partition, the other
            # is answered, and nothing is fenced.
            results = await replicate_many(
                [(first_leader, request(0, -1, epoch=2)), (second_leader, request(0, -1))],
                0, 8 << 20)
            assert isinstance(results[0], AtomlogError)
            assert results[0].reason == "NOT_PARTITION_OWNER"
            assert results[1] is not None and len(results[1].records) > 0
            assert first_leader.fenced is None and first_leader.failed is None
            # The follower holds both copies durably: both writes are acknowledged.
            for leader in leaders:
                await leader.replicate(request(1, 1), 0)
            await asyncio.wait_for(asyncio.gather(*produced), 10)
        finally:
            for owner, leader in ((first, first_leader), (second, second_leader)):
                await leader.close()
                await owner.close()

    asyncio.run(scenario())


def test_a_fetch_sessions_call_that_names_nothing_waits_and_answers_a_stirred_partition(
        tmp_path):
    """A fetch session's incremental call (docs/replication.md, "Fetch sessions") that
    names nothing and holds nothing active waits; a write to the session's quiet partition
    stirs it, and the same call looks at it and answers its records; without a write the
    call ends empty at its wait."""
    from partition_server.replica import ReplicateSession, replicate_many

    fsyncs = Fsyncs()

    async def scenario():
        owner, leader = await leading(tmp_path / "t-0", fsyncs)
        try:
            await leader.replicate(request(0, -1), 0)  # b holds the empty log: gate open
            session, asked = ReplicateSession(), request(0, -1)
            session_id = session.open({("t", 0): asked})
            items = [(leader, asked)]
            assert await replicate_many(items, 0, 8 << 20, 0, session) == [None]
            session.settle([("t", 0)], [])
            assert not session.active and session in leader.watchers

            def more() -> list:
                return [(leader, session.asked[key]) for key in session.take_stirred()]

            session.advance(session_id, 2, {}, [])
            assert session.working({}) == []
            loop = asyncio.get_running_loop()
            began = loop.time()
            assert await replicate_many([], 0.3, 8 << 20, 0, session, more) == []
            assert loop.time() - began >= 0.25  # waited for nothing
            session.advance(session_id, 3, {}, [])
            items = [(leader, session.asked[key]) for key in session.working({})]
            assert items == []
            waiting = asyncio.ensure_future(
                replicate_many(items, 5.0, 8 << 20, 0, session, more))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            produced = asyncio.ensure_future(owner.produce([batch(b"x" * 100)]))
            results = await asyncio.wait_for(waiting, 5)
            assert len(results) == 1 and results[0].log_end_offset == 1
            assert len(results[0].records) > 0
            assert items == [(leader, asked)]  # (the call's items, extended)
            await leader.replicate(request(1, 1), 0)  # b holds it: acknowledged
            await asyncio.wait_for(produced, 10)
        finally:
            await leader.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_throttled_reassignment_paces_its_new_replica_and_no_one_else(tmp_path):
    """A reassignment's throttle (docs/replication.md, "Reassignment"): the new replica,
    not in sync yet, is sent at most the throttle's rate after a one-second burst (its
    long poll waits for the bucket to refill instead of spinning); the in-sync follower
    is sent everything at once, and so is the new replica once it is in sync."""
    from partition_server.replica import replicate_many

    fsyncs = Fsyncs()
    rate = 40_000  # bytes/s
    value = b"v" * 9_000  # one batch: about 9 KB

    def ask(replica: str, fetch: int) -> partition_pb2.ReplicateRequest:
        req = request(fetch, -1 if fetch == 0 else 1)
        req.replica = replica
        return req

    async def scenario():
        owner, leader = await leading(tmp_path / "t-0", fsyncs)
        try:
            await leader.replicate(request(0, -1), 0)  # b holds the empty log: gate open
            leader.reassigned(["a", "b", "c"], ["a", "b", "c"], rate)
            produced = asyncio.ensure_future(owner.produce([batch(value) for _ in range(12)]))
            await wait_for(lambda: leader.log_end == 12, "the leader's appends")
            # b, in sync, is not throttled: all 12 batches in one answer.
            answer = await leader.replicate(request(0, -1), 0)
            assert len(list(iter_batches(memoryview(answer.records)))) == 12
            # c: about one second's worth at once, then the throttle's pace.
            loop = asyncio.get_running_loop()
            began, fetch, sizes = loop.time(), 0, []
            while fetch < 12:
                [result] = await replicate_many([(leader, ask("c", fetch))], 5.0, 8 << 20)
                assert result is not None, "a long poll ended with nothing for c"
                copied = list(iter_batches(memoryview(result.records)))
                sizes.append(len(result.records))
                fetch = copied[-1][1].last_offset + 1
            elapsed = loop.time() - began
            total = sum(sizes)
            assert sizes[0] <= rate + len(value) + 200  # the burst, plus a whole batch
            assert elapsed >= (total - rate - len(value)) / rate * 0.9, (elapsed, sizes)
            assert elapsed < total / rate + 2
            status = partition_pb2.ReplicationStatus()
            leader.status(status)
            assert status.reassignment_throttle_bytes_per_s == rate
            # In sync, c is no longer paced; lifting the throttle works the same way.
            await leader.replicate(ask("c", 12), 0)
            await leader.replicate(request(12, 1), 0)
            await asyncio.wait_for(produced, 10)
            leader.reassigned(["a", "b", "c"], ["a", "b", "c"], 0)
            assert leader.throttle is None and leader.throttle_wait_s("c") == 0
        finally:
            fsyncs.release()
            await leader.close()
            await owner.close()

    asyncio.run(scenario())


def test_only_the_latest_process_of_a_follower_can_bring_it_into_the_isr(tmp_path):
    """docs/replication.md, "Incarnations": a fetch names the follower's incarnation (the
    zxid its process wrote at start). A newer incarnation's first fetch makes the leader
    forget what the older one showed; an older one's fetch is refused once a newer one
    was seen; and an ISR expansion checked in ZooKeeper against a newer incarnation than
    the one that fetched (a fetch of the dead process, handled after its successor began:
    this leader never saw the successor) adds nothing and forgets those positions."""
    from partition_server.partition_states import StaleIncarnation

    writes: list[tuple[list[str], dict[str, int]]] = []
    latest = {"b": 9}  # b's process 5 died; process 9 began (its disk may be empty)

    async def write_isr(known, isr, joining):
        writes.append((isr, dict(joining)))
        stale = {r: latest[r] for r, incarnation in joining.items() if latest[r] != incarnation}
        if stale:
            raise StaleIncarnation(stale)
        return Versioned(PartitionState("a", 1, tuple(isr)), known.version + 1)

    async def scenario():
        owner, replication = await leading_alone(tmp_path / "t-0", write_isr)
        try:
            await owner.produce([batch(b"one"), batch(b"two")])  # ISR {a}: acknowledged
            assert replication.high_watermark == 2
            # Process 5's fetches, the last one caught up (sent before it died, handled now).
            await replication.replicate(fetch(0, 5), 0)
            await replication.replicate(fetch(2, 5), 0)
            await wait_for(lambda: writes, "an ISR expansion")
            assert writes[0] == (["a", "b"], {"b": 5})
            await asyncio.sleep(0.1)
            assert replication.progress.isr == {"a"}  # nothing written
            assert replication.progress.followers["b"].durable_end == 0  # forgotten
            with pytest.raises(AtomlogError) as refused:
                await replication.replicate(fetch(2, 5), 0)
            assert refused.value.reason == "STALE_REPLICA_INCARNATION"
            # Process 9 starts from nothing; it joins once it has copied everything.
            answer = await replication.replicate(fetch(0, 9), 0)
            assert answer.records
            await asyncio.sleep(0.2)
            assert len(writes) == 1 and replication.progress.isr == {"a"}
            await replication.replicate(fetch(2, 9), 0)
            await wait_for(lambda: replication.progress.isr == {"a", "b"}, "b to join")
            assert writes[-1] == (["a", "b"], {"b": 9})
            # A fetch of yet another process (11) of b: what 9 showed no longer counts.
            await replication.replicate(fetch(0, 11), 0)
            assert replication.progress.followers["b"].durable_end == 0
            assert replication.high_watermark == 2  # (never goes back)
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_follower_joining_the_isr_counts_for_acks_while_its_expansion_is_written(
        tmp_path):
    """b caught up with the high watermark, so the leader began writing the ISR with b in
    it. While that ZooKeeper write ran, writes were acknowledged by the old ISR ({a})
    alone: once it was stored, b was in sync without them, and an election of b lost
    them. Now a joiner counts for the high watermark from the moment its write begins
    (Kafka's maximal ISR, KIP-497)."""
    release = asyncio.Event()
    writes: list[list[str]] = []

    async def write_isr(known, isr, joining):
        writes.append(isr)
        await release.wait()
        return Versioned(PartitionState("a", 1, tuple(isr)), known.version + 1)

    async def scenario():
        owner, replication = await leading_alone(tmp_path / "t-0", write_isr)
        try:
            await owner.produce([batch(b"one"), batch(b"two")])  # ISR {a}: acknowledged
            await replication.replicate(fetch(0, 5), 0)
            await replication.replicate(fetch(2, 5), 0)  # b holds the high watermark
            await wait_for(lambda: writes, "the ISR expansion's write")
            produced = asyncio.ensure_future(owner.produce([batch(b"three")]))
            await wait_for(lambda: replication.local_durable_end == 3, "the leader's fsync")
            await asyncio.sleep(0.1)
            assert not produced.done() and replication.high_watermark == 2
            release.set()
            await wait_for(lambda: replication.progress.isr == {"a", "b"}, "b to join")
            assert not produced.done()
            await replication.replicate(fetch(3, 5), 0)  # b holds it: acknowledged
            assert (await asyncio.wait_for(produced, 10))[0].base_offset == 2
            assert replication.high_watermark == 3
        finally:
            release.set()
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_leadership_loaded_in_data_loss_resigns_once_an_operator_recovers_it(tmp_path):
    """A leader's copy loaded in DATA_LOSS (damage recorded before a restart), with no
    other live replica of the ISR to hand over to: its leadership waits for an heir. The
    operator's recover then reloaded the log, but the leadership stayed given up and
    heir-only for good (its first load had ended before the epochs were set up), so
    clients and followers got NOT_PARTITION_OWNER until another restart. Now the
    recovery gives the epoch up to any replica, this one included, as after any reload."""
    directory = tmp_path / "t-0"
    resigns: list[tuple[int, bool]] = []

    async def resign(given_up: int, heir_only: bool = False) -> Versioned | None:
        resigns.append((given_up, heir_only))
        return None if heir_only else Versioned(PartitionState("a", given_up + 1, ("a",)), 9)

    async def no_isr_writes(_known, isr, _joining):
        raise AssertionError(f"unexpected ISR write {isr}")

    async def scenario():
        owner = PartitionOwner("t", 0, directory, OwnerSettings(log=LogConfig()))
        await owner.start()
        await owner.produce([batch(b"one"), batch(b"two"), batch(b"three")])
        assert owner.log.report_corruption(0, 0, 0, "damage (test)")
        await owner.close()
        known = Versioned(PartitionState("a", 2, ("a",)), 0)
        replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 1, 10_000, 0,
                                        directory, no_isr_writes, lambda: {"a"},
                                        resign=resign)
        owner = PartitionOwner("t", 0, directory, OwnerSettings(log=LogConfig()))
        owner.replication, replication.owner = replication, owner
        await owner.start()
        replication.start()
        try:
            assert owner.state is State.DATA_LOSS
            await wait_for(lambda: resigns, "the heir-only resignation")
            assert resigns[0] == (2, True)
            loss = owner.log.data_loss
            await owner.recover_data_loss(loss.path, loss.offset)
            await wait_for(lambda: (2, False) in resigns, "the epoch given up to anyone")
            await wait_for(lambda: replication.fenced is not None, "the leadership to end")
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_writes_are_refused_at_once_while_a_retry_waits_for_a_short_isr(tmp_path):
    """With the ISR below min.insync.replicas, a retry of a written batch waits (it is
    answered as a duplicate once the ISR holds it again) while new writes are refused
    with NOT_ENOUGH_REPLICAS. Once a producer-state snapshot fell due meanwhile, the
    owner stopped writing until it could take it, which needs that retry answered: every
    new write hung, unanswered, until the ISR grew back. Refusals append nothing, so they
    go on while the snapshot waits."""
    fsyncs = Fsyncs()

    def idempotent(sequence: int):
        data = encode_batch([Record(b"k", b"v")], producer_id=7, producer_epoch=0,
                            base_sequence=sequence)
        return data, parse_header(data)

    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", fsyncs)
        try:
            await replication.replicate(request(0, -1), 0)
            produced = asyncio.ensure_future(owner.produce([idempotent(0)]))
            await wait_for(lambda: replication.local_durable_end == 1, "the first fsync")
            await replication.replicate(request(1, 1), 0)  # b holds it: acknowledged
            await asyncio.wait_for(produced, 10)
            replication.isr_changed(["a"])  # b left: below min.insync.replicas (2)
            retry = asyncio.ensure_future(owner.produce([idempotent(0)]))
            await asyncio.sleep(0.1)
            assert not retry.done()  # a duplicate, answered once the ISR holds it
            owner._last_snapshot_ms = 0  # a snapshot falls due meanwhile
            [refused] = await asyncio.wait_for(owner.produce([batch(b"new")]), 5)
            assert isinstance(refused, AtomlogError), refused
            assert refused.reason == "NOT_ENOUGH_REPLICAS"
            assert not retry.done()
            retry.cancel()
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_followers_restart_is_logged_once_at_info_however_many_partitions_see_it(
        tmp_path):
    """Every partition a restarted follower fetches from sees its new incarnation; the
    server logs the restart at INFO once, the other partitions at DEBUG."""
    async def write_isr(known, isr, joining):
        return Versioned(PartitionState("a", 1, tuple(isr)), known.version + 1)

    def fetch(partition: int, incarnation: int) -> partition_pb2.ReplicateRequest:
        req = partition_pb2.ReplicateRequest(replica="z-restarts", leader_epoch=1,
                                             fetch_offset=0, last_fetched_epoch=-1,
                                             replica_incarnation=incarnation)
        req.topic_partition.topic, req.topic_partition.partition = "t", partition
        return req

    seen = _Records()

    async def scenario():
        leaders = []
        for partition in range(3):
            directory = tmp_path / f"t-{partition}"
            known = Versioned(PartitionState("a", 1, ("a",)), 0)
            replication = LeaderReplication("t", partition, "a", known, ["a", "z-restarts"],
                                            1, 10_000, 0, directory, write_isr,
                                            lambda: {"a", "z-restarts"})
            owner = PartitionOwner("t", partition, directory, OwnerSettings(log=LogConfig()))
            owner.replication, replication.owner = replication, owner
            await owner.start()
            replication.start()
            leaders.append((owner, replication))
        try:
            for _, replication in leaders:
                await replication.replicate(fetch(replication.partition, 5), 0)
            replica_log = logging.getLogger("atomlog.partition.replica")
            level = replica_log.level
            replica_log.addHandler(seen)
            replica_log.setLevel(logging.DEBUG)
            try:
                for _, replication in leaders:
                    await replication.replicate(fetch(replication.partition, 8), 0)
            finally:
                replica_log.removeHandler(seen)
                replica_log.setLevel(level)
        finally:
            for owner, replication in leaders:
                await replication.close()
                await owner.close()

    asyncio.run(scenario())
    restarts = [r for r in seen.records if r.getMessage() == "follower restarted"]
    assert [r.levelno for r in restarts] == [logging.INFO, logging.DEBUG, logging.DEBUG]


def test_close_ends_the_isr_task_even_when_an_isr_change_was_just_poked(tmp_path):
    """On Python 3.11 asyncio.wait_for swallows a cancellation that arrives as the event
    it waits on is set: the ISR task, cancelled right after an ISR change was poked (a
    restarted follower's first fetch does), went on, and close() waited forever."""
    async def write_isr(known, isr, joining):
        return Versioned(PartitionState("a", 1, tuple(isr)), known.version + 1)

    async def scenario():
        known = Versioned(PartitionState("a", 1, ("a",)), 0)
        replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 1, 10_000, 0,
                                        tmp_path / "t-0", write_isr, lambda: {"a", "b"})
        replication.start()
        for _ in range(20):
            await asyncio.sleep(0.01)  # the ISR task waits on its event
            replication._poke_isr()
            await asyncio.sleep(0)  # the event's waiter is woken: the wait is ending
            await asyncio.wait_for(asyncio.shield(replication.close()), 5)
            replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 1, 10_000, 0,
                                            tmp_path / "t-0", write_isr, lambda: {"a", "b"})
            replication.start()
        await replication.close()

    asyncio.run(scenario())


def test_an_isr_task_that_fails_gives_the_epoch_up_instead_of_ending_silently(tmp_path):
    """An error escaping the ISR task's rounds (a defect: ZooKeeper's and the followers'
    faults are handled in them) used to end the task alone. The leadership went on
    serving with an ISR that could never change again: a follower that stopped kept
    every acknowledgement waiting. Now the epoch is given up, as after a failed write,
    and epoch + 1 is written."""
    resigned: list[int] = []

    async def scenario():
        owner, replication = await leading(tmp_path / "t-0", Fsyncs(), resigned=resigned)
        try:
            await acknowledge_first(owner, replication, b"one")
            calls = []

            def broken_wanted_isr():
                calls.append(1)
                raise RuntimeError("a defect in the ISR rule (test)")

            replication._wanted_isr = broken_wanted_isr
            replication._poke_isr()
            await wait_for(lambda: replication.fenced is not None, "the epoch given up")
            assert calls == [1]
            assert replication._isr_task.done() and not replication._isr_task.cancelled()
            assert replication._isr_task.exception() is None  # handled, not lost
            assert "its ISR task failed (RuntimeError" in replication.failed
            assert resigned == [1]
            with pytest.raises(AtomlogError) as refused:
                await owner.produce([batch(b"two")])
            assert refused.value.reason == "NOT_PARTITION_OWNER"
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_replica_a_reassignment_adds_is_not_counted_as_under_replication(tmp_path):
    """`atomlog_partitions_under_replicated` counted a partition whose ISR was shorter
    than its replica list, which during a reassignment holds the new replicas too: every
    reassignment copying for longer than 5 minutes (a throttled one: hours) fired
    AtomlogPartitionsUnderReplicated, whose runbook blames a down follower. A replica the
    reassignment adds and that has not caught up yet is a copy being made, as Kafka
    counts it; a replica lost meanwhile still counts."""
    fsyncs = Fsyncs()

    async def scenario():
        owner, leader = await leading(tmp_path / "t-0", fsyncs)
        try:
            await leader.replicate(request(0, -1), 0)  # b in sync: the ISR is {a, b}
            assert not leader.under_replicated()
            leader.reassigned(["a", "c", "b"], ["a", "c"])  # b moves to c
            assert set(leader.progress.isr) == {"a", "b"}
            assert not leader.under_replicated()  # c is being made; nothing is lost
            leader.progress.isr_changed(["a"])  # b lost meanwhile
            assert leader.under_replicated()
            leader.reassigned(["a", "b"], None)  # (cancelled: back to a and b)
            assert leader.under_replicated() and not leader.adding
        finally:
            await owner.close()

    asyncio.run(scenario())


def test_a_wall_clock_stepped_back_does_not_keep_a_stopped_follower_in_the_isr(
        tmp_path, monkeypatch):
    """Followers' lag (when each last caught up) lives in the leader's memory only but
    was measured on the wall clock: stepped back an hour, a follower that stopped
    fetching stayed in the ISR for the hour, and with it the high watermark, every
    acknowledged write and every cursor change waiting for it. It is measured on the
    process's steady clock now."""
    import time

    fsyncs = Fsyncs()
    real = time.time

    async def scenario():
        owner, leader = await leading(tmp_path / "t-0", fsyncs)
        try:
            leader.progress.max_lag_ms = 300
            await leader.replicate(request(0, -1), 0)  # b caught up, then stops fetching
            assert leader._wanted_isr(live={"a", "b"}) is None
            monkeypatch.setattr(time, "time", lambda: real() - 3_600)  # stepped back
            await asyncio.sleep(0.5)
            assert leader._wanted_isr(live={"a", "b"}) == {"a"}
        finally:
            await owner.close()

    asyncio.run(scenario())
