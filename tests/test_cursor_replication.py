"""Replication of subscription cursors (docs/replication.md, "Cursors"), without processes:
the leader's view of its followers' cursor journals (`replication.CursorProgress`, a
pure core), the store's side on real files — a replicating leader's `replication_read`
(durable frames only; its base snapshot when a follower is too far behind, foreign or new),
a follower's `append_copied` (byte for byte, all or nothing) and `install_snapshot`
(swapped in whole; a crash mid-way leaves the old store or the new). A seeded random run
copies a busy leader, with snapshots, crashes of either side and leader reopenings, and
checks after every round that the follower — and the follower opened as a promoted leader
would open it — holds exactly the leader's durable cursors. And the leader's shell
in-process (a real PartitionOwner with a LeaderReplication, the follower's calls made by
hand): a change answered only once the follower reports its frame, the snapshot sent
without records, NOT_ENOUGH_REPLICAS staging nothing, a too-large snapshot withheld."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from partition_server.cursor_store import (
    CursorStore,
    CursorStoreLimits,
    StoreEntry,
    decode_store_snapshot,
    encode_frame,
    install_snapshot,
)
from partition_server.record_batch import TxnId
from partition_server.replication import NOT_SYNCED, CursorProgress
from partition_server.snapshot_files import SnapshotCorrupt
from partition_server.subscription_cursor import Acked, OffsetRange
from services.errors import AtomlogError

LIMIT = 10_000
SMALL = CursorStoreLimits(snapshot_interval_entries=7, max_journal_bytes=4096)


def states(store: CursorStore) -> dict:
    return {name: cursor.state() for name, cursor in store.cursors().items()}


def create(store: CursorStore, name: str, position: int = 0) -> None:
    store.stage(store.plan_create(name, position))


def ack(store: CursorStore, name: str, cumulative_end: int = 0, ranges=(), txn=None) -> None:
    entry = store.cursor(name).check_ack(cumulative_end, ranges, txn, limit=LIMIT)
    if entry is not None:
        store.stage(StoreEntry(name, entry))


def copy(leader: CursorStore, directory: Path, follower: CursorStore | None,
         max_bytes: int = 1 << 20, limits: CursorStoreLimits = SMALL) -> CursorStore:
    """One follower round: what the leader answers for the follower's position, applied
    as partition_server/replica.py's Follower does."""
    position = follower.durable_end if follower is not None else NOT_SYNCED
    snapshot, first, frames = leader.replication_read(position, max_bytes)
    if snapshot is not None:
        if follower is not None:
            follower.close()
        install_snapshot(directory, snapshot, limits)
        follower = CursorStore.open(directory, limits)
    if frames:
        assert first == follower.appended_end
        follower.append_copied(frames)
        follower.sync()
        follower.maybe_snapshot()
    return follower


def catch_up(leader: CursorStore, directory: Path, follower: CursorStore | None,
             max_bytes: int = 1 << 20) -> CursorStore:
    for _ in range(1_000):
        follower = copy(leader, directory, follower, max_bytes)
        if follower.durable_end == leader.durable_end:
            return follower
    raise AssertionError("the follower never caught up")


# ---------------------------------------------------------------------------------------
# CursorProgress: the cursor high watermark over the ISR
# ---------------------------------------------------------------------------------------

def test_the_cursor_high_watermark_is_the_smallest_durable_position_over_the_isr():
    progress = CursorProgress("a", ["a", "b", "c"])
    progress.leader_durable(10)
    isr = {"a", "b", "c"}
    assert progress.high_watermark(isr) == 0  # nobody synced: nothing acknowledged
    assert progress.fetched("b", 10, 0) == 10
    assert progress.high_watermark(isr) == 0  # c holds nothing of this leadership yet
    assert progress.high_watermark({"a", "b"}) == 10  # c left the ISR
    progress.leader_durable(15)
    assert progress.fetched("c", 12, 0) == 12
    assert progress.high_watermark(isr) == 10
    progress.fetched("b", 15, 0)
    assert progress.high_watermark(isr) == 12
    assert progress.lag() == {"b": 0, "c": 3}


def test_the_cursor_high_watermark_never_goes_back():
    """A follower that restarts reports NOT_SYNCED until it installed the snapshot; what
    it held is still on its disk, so what was acknowledged stays acknowledged."""
    progress = CursorProgress("a", ["a", "b"])
    progress.leader_durable(8)
    progress.fetched("b", 8, 0)
    assert progress.high_watermark({"a", "b"}) == 8
    progress.fetched("b", NOT_SYNCED, 0)
    progress.leader_durable(9)
    assert progress.high_watermark({"a", "b"}) == 8
    assert progress.lag() == {"b": -1}


def test_a_follower_claiming_frames_the_leader_lacks_must_start_over():
    progress = CursorProgress("a", ["a", "b"])
    progress.leader_durable(5)
    assert progress.fetched("b", 6, 0) == NOT_SYNCED  # another leadership's history
    assert progress.positions["b"] == NOT_SYNCED
    with pytest.raises(AtomlogError) as outsider:
        progress.fetched("z", 0, 0)
    assert outsider.value.reason == "NOT_A_REPLICA"
    with pytest.raises(AtomlogError) as bad:
        progress.fetched("b", -2, 0)
    assert bad.value.reason == "INVALID_ARGUMENT"


def test_only_a_follower_holding_the_cursor_high_watermark_may_join_the_isr():
    progress = CursorProgress("a", ["a", "b", "c"])
    progress.leader_durable(20)
    progress.fetched("b", 20, 0)
    isr = {"a", "b"}
    assert progress.high_watermark(isr) == 20
    assert not progress.holds("c", isr)  # not synced
    progress.fetched("c", 19, 0)
    assert not progress.holds("c", isr)  # behind an acknowledged change
    progress.fetched("c", 20, 0)
    assert progress.holds("c", isr)


def test_a_follower_whose_cursors_lag_past_max_lag_leaves_the_isr():
    progress = CursorProgress("a", ["a", "b", "c"], now_ms=1_000)
    progress.leader_durable(4)
    isr = {"a", "b", "c"}
    assert progress.lagging(isr, 11_000, 10_000) == set()  # each gets max_lag_ms at first
    progress.fetched("b", 4, 5_000)  # caught up
    progress.fetched("c", 3, 5_000)  # behind: not caught up
    assert progress.lagging(isr, 11_001, 10_000) == {"c"}
    assert progress.lagging({"a", "b"}, 11_001, 10_000) == set()  # only ISR members
    progress.leader_durable(6)
    progress.fetched("c", 6, 12_000)
    assert progress.lagging(isr, 15_001, 10_000) == {"b"}
    # Under a steady stream no call finds the leader's end unmoved: a follower holding
    # what there was at its previous call was caught up then.
    progress.leader_durable(8)
    progress.fetched("b", 4, 16_000)  # holds the end as of its call at 5 s
    assert progress.caught_up_ms["b"] == 5_000
    progress.leader_durable(10)
    progress.fetched("b", 8, 17_000)  # holds the end as of its call at 16 s
    assert progress.caught_up_ms["b"] == 16_000
    assert progress.lagging(isr, 25_000, 10_000) == {"c"}  # silent since 12 s


# ---------------------------------------------------------------------------------------
# The store: what a replicating leader serves, what a follower applies
# ---------------------------------------------------------------------------------------

@pytest.fixture
def leader(tmp_path):
    store = CursorStore.open(tmp_path / "leader" / "cursors", SMALL, retain_frames=True)
    yield store
    store.close(sync=False)


def test_a_follower_gets_the_snapshot_then_only_durable_frames(tmp_path, leader):
    create(leader, "billing")
    ack(leader, "billing", ranges=[(2, 4)])
    leader.sync()
    directory = tmp_path / "follower" / "cursors"
    follower = copy(leader, directory, None)
    assert follower.durable_end == leader.durable_end == 2
    assert states(follower) == states(leader)
    ack(leader, "billing", ranges=[(6, 7)])  # staged, not durable on the leader
    snapshot, first, frames = leader.replication_read(follower.durable_end, 1 << 20)
    assert (snapshot, first, frames) == (None, 2, b"")
    leader.sync()
    snapshot, first, frames = leader.replication_read(2, 1 << 20)
    assert snapshot is None and first == 2 and frames
    follower.append_copied(frames)
    follower.sync()
    assert states(follower) == states(leader) and follower.durable_end == 3
    follower.close()
    reopened = CursorStore.open(directory, SMALL)  # a restart, or a promotion
    assert states(reopened) == states(leader) and reopened.appended_end == 3
    reopened.close()


def test_frames_come_in_bounded_pieces_of_at_least_one_frame(tmp_path, leader):
    create(leader, "billing")
    for offset in range(0, 40, 2):
        ack(leader, "billing", ranges=[(offset, offset + 1)])
    leader.sync()
    _, _, frames = leader.replication_read(1, 1)
    assert len(frames) < 200  # one frame
    follower = catch_up(leader, tmp_path / "f" / "cursors", None, max_bytes=64)
    assert states(follower) == states(leader)
    follower.close()


def test_a_follower_behind_the_leaders_snapshot_or_ahead_of_it_starts_over(tmp_path, leader):
    create(leader, "billing")
    leader.sync()
    directory = tmp_path / "f" / "cursors"
    follower = copy(leader, directory, None)
    for offset in range(0, 60, 2):  # past several snapshots (every 7 entries)
        ack(leader, "billing", ranges=[(offset, offset + 1)])
        leader.sync()
        leader.maybe_snapshot()
    snapshot, first, _ = leader.replication_read(follower.durable_end, 1 << 20)
    assert snapshot is not None and first > follower.durable_end
    assert decode_store_snapshot(snapshot)[0] == first
    follower = catch_up(leader, directory, follower)
    assert states(follower) == states(leader)
    snapshot, _, _ = leader.replication_read(leader.durable_end + 5, 1 << 20)
    assert snapshot is not None  # a position the leader never had: not its history
    follower.close()


def test_a_bad_frame_refuses_every_frame_and_changes_nothing(tmp_path, leader):
    create(leader, "billing")
    leader.sync()
    directory = tmp_path / "f" / "cursors"
    follower = copy(leader, directory, None)
    before, end = states(follower), follower.appended_end
    good = encode_frame(end, StoreEntry("billing", Acked(None, 0, (OffsetRange(1, 2),))))
    for bad in [
        good + encode_frame(end + 2, StoreEntry("billing", Acked(None, 0, (OffsetRange(3, 4),)))),
        good + encode_frame(end + 1, StoreEntry("nobody", Acked(None, 0, (OffsetRange(3, 4),)))),
        good + good[:-1] + bytes([good[-1] ^ 1]),
        good[:-3],
    ]:
        with pytest.raises(AtomlogError) as refused:
            follower.append_copied(bad)
        assert refused.value.reason == "CORRUPT_BATCH"
        assert states(follower) == before and follower.appended_end == end
    follower.append_copied(good)
    assert follower.appended_end == end + 1
    follower.close()


def test_install_replaces_the_store_whole_and_a_crash_leaves_old_or_new(tmp_path, leader):
    create(leader, "billing")
    ack(leader, "billing", ranges=[(3, 5)])
    leader.sync()
    leader.snapshot()  # the base a follower starts from is now everything
    snapshot, first, frames = leader.replication_read(NOT_SYNCED, 1 << 20)
    assert first == leader.durable_end and frames == b""
    directory = tmp_path / "f" / "cursors"
    old = CursorStore.open(directory, SMALL)
    create(old, "stale")  # state the leader does not have
    old.sync()
    old.close()
    with pytest.raises(SnapshotCorrupt):
        install_snapshot(directory, snapshot[:-1] + bytes([snapshot[-1] ^ 1]))
    unchanged = CursorStore.open(directory, SMALL)
    assert list(unchanged.cursors()) == ["stale"]
    unchanged.close()
    # A crash while `.new` was being built: the old store stays, the partial build goes.
    building = directory.with_name("cursors.new")
    building.mkdir()
    (building / "junk").write_bytes(b"x")
    reopened = CursorStore.open(directory, SMALL)
    assert list(reopened.cursors()) == ["stale"] and not building.exists()
    reopened.close()
    # A crash between the two renames: the complete `.new` goes in.
    install_snapshot(tmp_path / "g" / "cursors", snapshot)
    os.rename(directory, directory.with_name("cursors.old"))
    os.rename(tmp_path / "g" / "cursors", building)
    reopened = CursorStore.open(directory, SMALL)
    assert states(reopened) == states(leader)
    assert not building.exists() and not directory.with_name("cursors.old").exists()
    reopened.close()
    install_snapshot(directory, snapshot)  # and the plain way
    reopened = CursorStore.open(directory, SMALL)
    assert states(reopened) == states(leader) and reopened.appended_end == leader.durable_end
    reopened.close()


def test_a_reopened_leader_serves_followers_from_what_it_recovered(tmp_path, leader):
    create(leader, "billing")
    for offset in range(0, 30, 2):
        ack(leader, "billing", ranges=[(offset, offset + 1)])
        leader.sync()
        leader.maybe_snapshot()
    directory = tmp_path / "f" / "cursors"
    follower = catch_up(leader, directory, None)
    expected = states(leader)
    leader.close(sync=False)
    again = CursorStore.open(leader.directory, SMALL, retain_frames=True)
    try:
        assert states(again) == expected
        snapshot, first, frames = again.replication_read(follower.durable_end, 1 << 20)
        assert snapshot is None and first == follower.durable_end and frames == b""
        ack(again, "billing", ranges=[(100, 101)])
        again.sync()
        follower = catch_up(again, directory, follower)
        assert states(follower) == states(again)
        follower.close()
    finally:
        again.close(sync=False)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_random_copying_with_crashes_matches_the_leader(tmp_path, seed):
    """Seeded: a busy leader (creates, plain and transactional acks, markers, resets,
    deletes, snapshots), a follower copying in random-sized pieces, and crashes of both
    (staged entries lost). After every round the follower's durable cursors, and the
    store a promotion would open from its directory, equal the leader's durable ones."""
    print(f"seed {seed}")
    rng = random.Random(seed)
    leader_dir, directory = tmp_path / "l" / "cursors", tmp_path / "f" / "cursors"
    leader = CursorStore.open(leader_dir, SMALL, retain_frames=True)
    follower: CursorStore | None = None
    txns = [TxnId(1, n) for n in range(1, 6)]
    try:
        for _round in range(60):
            for _ in range(rng.randrange(1, 6)):
                _random_change(leader, rng, txns)
            if rng.random() < 0.8:
                leader.sync()
            if rng.random() < 0.3:
                leader.maybe_snapshot()
            if rng.random() < 0.1:  # the leader crashes (and is reopened, same epoch)
                leader.close(sync=False)
                leader = CursorStore.open(leader_dir, SMALL, retain_frames=True)
            if rng.random() < 0.1 and follower is not None:  # the follower crashes
                follower.close(sync=False)
                follower = None  # a new follower session starts over from the snapshot
            durable = _durable_states(leader)
            follower = catch_up(leader, directory, follower,
                                max_bytes=rng.choice([1, 200, 1 << 20]))
            assert states(follower) == durable
            follower.close()
            promoted = CursorStore.open(directory, SMALL, retain_frames=True)
            assert states(promoted) == durable
            promoted.close()
            follower = CursorStore.open(directory, SMALL)
    finally:
        leader.close(sync=False)
        if follower is not None:
            follower.close(sync=False)


def _durable_states(leader: CursorStore) -> dict:
    """The leader's cursors as far as durable: sync what is staged first (the follower
    only ever copies durable frames; staged ones become durable with the next sync)."""
    leader.sync()
    return states(leader)


def _random_change(store: CursorStore, rng: random.Random, txns: list[TxnId]) -> None:
    names = sorted(store.cursors())
    try:
        roll = rng.random()
        if roll < 0.1 or not names:
            entry = store.plan_create(f"s{rng.randrange(4)}", rng.randrange(20))
            if entry is not None:
                store.stage(entry)
            return
        name = rng.choice(names)
        cursor = store.cursor(name)
        if roll < 0.15:
            store.stage(store.plan_delete(name))
        elif roll < 0.2:
            store.stage(StoreEntry(name, cursor.plan_reset(rng.randrange(200))))
        elif roll < 0.35:
            plan = cursor.plan_end_txn(rng.choice(txns), rng.random() < 0.5)
            if plan.entry is not None:
                store.stage(StoreEntry(name, plan.entry))
        else:
            start = rng.randrange(200)
            txn = rng.choice(txns) if rng.random() < 0.4 else None
            cumulative = start if rng.random() < 0.2 else 0
            ranges = [] if cumulative else [(start, start + rng.randrange(1, 4))]
            ack(store, name, cumulative, ranges, txn)
    except AtomlogError:
        pass  # refused (conflict, pending acks, ...): nothing changed


# ---------------------------------------------------------------------------------------
# The leader's shell in-process: a real PartitionOwner with a LeaderReplication, and the
# follower's Replicate calls made by hand (who calls when is the test's choice)
# ---------------------------------------------------------------------------------------

def _replicate_request(fetch: int, cursor_sequence: int):
    from atomlog.v1 import partition_pb2
    request = partition_pb2.ReplicateRequest(replica="b", leader_epoch=1, fetch_offset=fetch,
                                             last_fetched_epoch=-1 if fetch == 0 else 1,
                                             cursor_sequence=cursor_sequence)
    request.topic_partition.topic = "t"
    return request


async def _leading_owner(directory: Path, min_insync: int = 2):
    from partition_server.log import LogConfig
    from partition_server.owner import OwnerSettings, PartitionOwner
    from partition_server.partition_states import Versioned
    from partition_server.replica import LeaderReplication
    from partition_server.replication import PartitionState

    async def no_isr_writes(_known, isr, _joining):
        raise AssertionError(f"unexpected ISR write {isr}")

    known = Versioned(PartitionState("a", 1, ("a", "b")), 0)
    replication = LeaderReplication("t", 0, "a", known, ["a", "b"], min_insync, 10_000, 0,
                                    directory, no_isr_writes, lambda: {"a", "b"})
    owner = PartitionOwner("t", 0, directory, OwnerSettings(log=LogConfig()))
    owner.replication, replication.owner = replication, owner
    await owner.start()
    return owner, replication


def test_the_leader_answers_cursor_changes_once_the_isr_holds_them(tmp_path):
    import asyncio

    from partition_server.record_batch import Record, encode_batch, parse_header

    async def scenario():
        owner, replication = await _leading_owner(tmp_path / "t-0")
        try:
            batch = encode_batch([Record(b"k", b"v")])
            produced = asyncio.ensure_future(owner.produce([(batch, parse_header(batch))]))
            created = asyncio.ensure_future(owner.subscriptions.create("s", 0))
            await asyncio.sleep(0.2)
            assert not created.done()  # durable here, not yet on the in-sync follower
            # A follower that begins following gets the cursor snapshot, alone (no records).
            answer = await replication.replicate(_replicate_request(0, NOT_SYNCED), 0)
            assert answer.cursors_available and answer.cursor_snapshot and not answer.records
            directory = tmp_path / "follower" / "cursors"
            install_snapshot(directory, answer.cursor_snapshot)
            follower = CursorStore.open(directory)
            assert answer.cursor_first_sequence == follower.appended_end == 0
            follower.append_copied(answer.cursor_frames)
            follower.sync()
            assert list(follower.cursors()) == ["s"] and not created.done()
            # Its next call reports the frame: the change is answered; the records follow.
            answer = await replication.replicate(_replicate_request(0, follower.durable_end), 0)
            assert await asyncio.wait_for(created, 2) == (True, 0)
            assert answer.records and not answer.cursor_snapshot and not answer.cursor_frames
            await replication.replicate(_replicate_request(1, follower.durable_end), 0)
            await asyncio.wait_for(produced, 2)
            # Below min.insync.replicas a change is refused and nothing is staged.
            replication.progress.isr_changed({"a"})
            before = owner.subscriptions.store.appended_end
            with pytest.raises(AtomlogError) as refused:
                await owner.subscriptions.ack("s", 1, (), None, owner.max_read_position())
            assert refused.value.reason == "NOT_ENOUGH_REPLICAS"
            assert owner.subscriptions.store.appended_end == before
            assert owner.subscriptions.cumulative_end("s") == 0
            # Joining the existing subscription writes nothing: still served.
            assert await asyncio.wait_for(owner.subscriptions.create("s", 0), 2) == (False, 0)
            follower.close()
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_cursor_read_never_shows_a_change_staged_while_it_waited(tmp_path):
    """DescribeSubscription's check (service._cursors_replicated_for_reading) yields to
    the event loop while it waits for the follower; a change staged meanwhile (an ack
    right behind it, as the requests queued during a stall run one after another) must
    not be shown before the in-sync follower holds it too (chaos run ctp 2548: a stale
    leader showed such an ack, and its successor then showed the cursor without it)."""
    import asyncio
    import time

    from partition_server.record_batch import Record, encode_batch, parse_header
    from partition_server.service import _cursors_replicated_for_reading

    async def scenario():
        owner, replication = await _leading_owner(tmp_path / "t-0")
        directory = tmp_path / "follower" / "cursors"
        follower = None

        async def copy_and_report(offset: int) -> None:
            answer = await replication.replicate(_replicate_request(offset,
                                                                    follower.durable_end), 0)
            follower.append_copied(answer.cursor_frames)
            follower.sync()

        try:
            batch = encode_batch([Record(b"k", b"0"), Record(b"k", b"1")])
            produced = asyncio.ensure_future(owner.produce([(batch, parse_header(batch))]))
            created = asyncio.ensure_future(owner.subscriptions.create("s", 0))
            await asyncio.sleep(0.2)  # both written and durable here
            answer = await replication.replicate(_replicate_request(0, NOT_SYNCED), 0)
            install_snapshot(directory, answer.cursor_snapshot)
            follower = CursorStore.open(directory)
            follower.append_copied(answer.cursor_frames)
            follower.sync()
            await replication.replicate(_replicate_request(0, follower.durable_end), 0)
            await asyncio.wait_for(created, 2)
            await replication.replicate(_replicate_request(2, follower.durable_end), 0)
            await asyncio.wait_for(produced, 2)
            limit = owner.max_read_position()

            async def read() -> int:
                await _cursors_replicated_for_reading(owner)
                return owner.subscriptions.describe("s", limit,
                                                    int(time.time() * 1000)).cumulative_end

            first = asyncio.ensure_future(owner.subscriptions.ack("s", 1, (), None, limit))
            await asyncio.sleep(0.2)  # durable here; the read must wait for the follower
            reading = asyncio.ensure_future(read())
            await asyncio.sleep(0.1)
            await copy_and_report(2)  # the follower holds the first ack, not yet reported
            second = asyncio.ensure_future(owner.subscriptions.ack("s", 2, (), None, limit))
            await replication.replicate(_replicate_request(2, follower.durable_end), 0)
            assert await asyncio.wait_for(first, 2) == 1
            await asyncio.sleep(0.3)
            assert not reading.done() or reading.result() == 1, \
                "the read showed an ack no follower holds"
            await asyncio.sleep(0.2)  # the second ack is durable here
            await copy_and_report(2)
            await replication.replicate(_replicate_request(2, follower.durable_end), 0)
            assert await asyncio.wait_for(second, 2) == 2
            assert await asyncio.wait_for(reading, 2) in (1, 2)
        finally:
            if follower is not None:
                follower.close()
            await replication.close()
            await owner.close()

    asyncio.run(scenario())


def test_a_cursor_snapshot_too_large_to_send_is_withheld_and_the_log_still_flows(
        tmp_path, monkeypatch):
    import asyncio

    from partition_server import replica

    async def scenario():
        owner, replication = await _leading_owner(tmp_path / "t-0", min_insync=1)
        monkeypatch.setattr(replica, "REPLICATE_SNAPSHOT_MAX_BYTES", 1)  # any snapshot
        try:
            assert not replication._cursor_news(NOT_SYNCED)  # so the long poll waits
            answer = await replication.replicate(_replicate_request(0, NOT_SYNCED), 0)
            assert not answer.cursors_available and not answer.cursor_snapshot
            assert replication.cursors.positions["b"] == NOT_SYNCED
        finally:
            await replication.close()
            await owner.close()

    asyncio.run(scenario())
