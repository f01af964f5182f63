"""A follower's storage (docs/replication.md): copying the leader's batches byte for byte
at their offsets, cutting back by leader epoch, and restarting at the leader's log start —
on real files, checked against the leader's log and across reopen and crash copies. Each
follower test runs with the copies written around the page cache (O_DIRECT, as followers
write them by default: partition_server/direct_io.py) and buffered."""

from __future__ import annotations

import os

import pytest

from partition_server import direct_io
from partition_server.record_batch import parse_header
from services.errors import AtomlogError
from tests.test_log import Clock, crash_copy, make_batch, open_log, stored_batches


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request) -> bool:
    return request.param


def copied(leader, from_offset: int = 0) -> list[tuple[bytes, object]]:
    """What a Replicate answer carries: the leader's flushed batches from `from_offset`."""
    return [(batch, parse_header(batch)) for base, batch in stored_batches(leader)
            if base >= from_offset]


def test_copied_batches_keep_the_leaders_offsets_times_and_bytes(tmp_path, direct):
    leader = open_log(tmp_path / "leader", Clock(1_000_000), segment_bytes=1_200)
    leader.append([make_batch(3, 200), make_batch(1, 200)])
    leader.flush()
    leader.append([make_batch(4, 200)] * 3)
    leader.flush()
    # The follower's clock is behind the leader's: copies keep the leader's times anyway.
    follower = open_log(tmp_path / "follower", Clock(5), segment_bytes=1_200,
                        direct_copies=direct)
    items = copied(leader)
    assert follower.append_copied(items[:2]) == [0, 3]
    assert follower.append_copied(items[2:]) == [4, 8, 12]
    follower.flush()
    assert stored_batches(follower) == stored_batches(leader)
    assert follower.log_end_offset == leader.log_end_offset == 16
    assert len(follower.segments()) > 1  # rolled by its own segment size
    follower.close()
    reopened = open_log(tmp_path / "follower", Clock(5), segment_bytes=1_200,
                        direct_copies=direct)
    assert stored_batches(reopened) == stored_batches(leader) and reopened.data_loss is None
    assert reopened.recovery.clean_shutdown
    # The follower appends its own batches after the copies, as a new leader does.
    assert reopened.append([make_batch(2)]) == [16]
    reopened.flush()
    assert parse_header(stored_batches(reopened)[-1][1]).log_append_time_ms >= 1_000_000


def test_copies_start_segments_where_the_leaders_start_and_nowhere_else(tmp_path, direct):
    """With the leader's segment bases a follower rolls exactly where the leader did (by
    age, by hand, or by a smaller size than its own) and never by its own rules, copied
    in any slices; so deleting whole segments below a log start leaves both logs the
    same records. Bases that start no batch of a copy change nothing."""
    clock = Clock(1_000_000)
    leader = open_log(tmp_path / "leader", clock, segment_bytes=1_000, segment_ms=60_000)
    for i in range(12):
        leader.append([make_batch(2, 150)])
        leader.flush()
        if i in (2, 3):
            leader.roll()  # what the follower's own rules would never do here
        clock.now += 25_000  # rolls by age too
    leader_bases = [info.base_offset for info in leader.segments()]
    assert len(leader_bases) >= 6, leader_bases
    assert leader.segment_bases(0, 1) == [0]
    assert leader.segment_bases(leader_bases[1], leader.log_end_offset) == leader_bases[1:]
    assert leader.segment_bases(leader_bases[1] + 1, leader_bases[3]) == leader_bases[1:3]
    # The follower's own rules would roll by 10 KiB and a day.
    follower = open_log(tmp_path / "follower", Clock(5), segment_bytes=10_000,
                        segment_ms=86_400_000, direct_copies=direct)
    items = copied(leader)
    for start, end in ((0, 1), (1, 5), (5, 6), (6, 12)):
        first = items[start][1].base_offset
        last = items[end - 1][1].base_offset + items[end - 1][1].record_count
        follower.append_copied(items[start:end], segment_bases=leader.segment_bases(first, last))
    follower.flush()
    assert [info.base_offset for info in follower.segments()] == leader_bases
    assert stored_batches(follower) == stored_batches(leader)
    assert follower.delete_records(leader_bases[2] + 1) == leader.delete_records(
        leader_bases[2] + 1) == leader_bases[2]
    assert stored_batches(follower) == stored_batches(leader)
    # Without them (a leader that does not say) it rolls by its own rules: never here.
    other = open_log(tmp_path / "other", Clock(5), segment_bytes=10_000,
                     segment_ms=86_400_000, direct_copies=direct)
    other.append_copied(items)
    assert len(other.segments()) == 1
    # A base that starts no batch of the copy (the segment holding its first offset).
    again = open_log(tmp_path / "again", Clock(5), segment_bytes=10_000, direct_copies=direct)
    again.append_copied(items[:1], segment_bases=[0])
    again.append_copied(items[1:2], segment_bases=[0, 999])
    assert [info.base_offset for info in again.segments()] == [0]


def test_a_cut_at_a_segment_start_keeps_the_segments_of_a_leader_that_never_rolled_there(
        tmp_path, direct):
    """An old leader rolled at offset 4 and its follower copied that; the new leader has
    the batches below 4 and rolled nowhere there, then wrote its own from 4. The
    follower, cut back to 4, must not keep an empty segment starting at 4: its copies of
    the new leader's batches would start a segment there that the new leader does not
    have (chaos seed 2961: copies of one partition ending the same, their segment starts
    [0, 783, 1567, 1568, ...] on the two followers and [0, 783, 1568, ...] on the
    leader). Where the new leader does start a segment at the cut, its answer's
    segment_bases says so and the follower starts one there too."""
    old = open_log(tmp_path / "old-leader")
    old.append([make_batch(2, key=b"a"), make_batch(2, key=b"b")])
    old.roll()
    old.append([make_batch(2, key=b"x")])
    old.flush()
    assert [info.base_offset for info in old.segments()] == [0, 4]
    follower = open_log(tmp_path / "follower", direct_copies=direct)
    follower.append_copied(copied(old), segment_bases=old.segment_bases(0, 6))
    follower.flush()
    assert [info.base_offset for info in follower.segments()] == [0, 4]
    new = open_log(tmp_path / "new-leader")
    new.append_copied(copied(old)[:2], segment_bases=[0])
    new.append([make_batch(3, key=b"y")])
    new.flush()
    assert [info.base_offset for info in new.segments()] == [0]
    assert follower.truncate_to(4) == 4
    follower.append_copied(copied(new, 4), segment_bases=new.segment_bases(4, 7))
    follower.flush()
    assert stored_batches(follower) == stored_batches(new)
    assert [info.base_offset for info in follower.segments()] == [0]
    follower.close()
    reopened = open_log(tmp_path / "follower", direct_copies=direct)
    assert reopened.data_loss is None and stored_batches(reopened) == stored_batches(new)
    assert [info.base_offset for info in reopened.segments()] == [0]
    # A new leader that did roll at the cut: the follower starts a segment there too.
    rolled = open_log(tmp_path / "rolled-leader")
    rolled.append_copied(copied(old)[:2], segment_bases=[0])
    rolled.roll()
    rolled.append([make_batch(1, key=b"z")])
    rolled.flush()
    assert reopened.truncate_to(4) == 4
    reopened.append_copied(copied(rolled, 4), segment_bases=rolled.segment_bases(4, 5))
    reopened.flush()
    assert stored_batches(reopened) == stored_batches(rolled)
    assert [info.base_offset for info in reopened.segments()] == [0, 4]
    # The first segment is never removed: a cut to its start leaves it, empty.
    assert reopened.truncate_to(0) == 0
    assert [info.base_offset for info in reopened.segments()] == [0]


def test_a_copy_recovered_at_a_segments_first_batch_keeps_no_segment_start_there(
        tmp_path, direct):
    """The same through an accepted DATA_LOSS (a follower's corrupt copy is cut at the
    damage when it opens: replica.Follower._open): damage in the first batch of a
    segment must not leave that segment, empty, for the new leader's batches."""
    from pathlib import Path
    old = open_log(tmp_path / "old-leader")
    old.append([make_batch(2, key=b"a"), make_batch(2, key=b"b")])
    old.roll()
    old.append([make_batch(2, key=b"x"), make_batch(2, key=b"z")])
    old.flush()
    directory = tmp_path / "follower"
    follower = open_log(directory, direct_copies=direct)
    follower.append_copied(copied(old), segment_bases=old.segment_bases(0, 8))
    follower.flush()
    assert [info.base_offset for info in follower.segments()] == [0, 4]
    victim = Path(follower.segments()[1].path)
    follower.close()
    data = bytearray(victim.read_bytes())
    data[40] ^= 0x80  # inside the first batch of segment 4
    victim.write_bytes(bytes(data))
    broken = open_log(directory, direct_copies=direct)
    loss = broken.data_loss
    assert (loss.position, loss.offset) == (0, 4)
    broken.recover_data_loss(loss.path, loss.offset)
    assert broken.log_end_offset == 4
    assert [info.base_offset for info in broken.segments()] == [0]
    new = open_log(tmp_path / "new-leader")
    new.append_copied(copied(old)[:2], segment_bases=[0])
    new.append([make_batch(3, key=b"y")])
    new.flush()
    broken.append_copied(copied(new, 4), segment_bases=new.segment_bases(4, 7))
    broken.flush()
    assert stored_batches(broken) == stored_batches(new)
    assert [info.base_offset for info in broken.segments()] == [0]


def test_a_gap_or_overlap_is_refused_and_writes_nothing(tmp_path, direct):
    leader = open_log(tmp_path / "leader")
    leader.append([make_batch(2), make_batch(3), make_batch(1)])
    leader.flush()
    follower = open_log(tmp_path / "follower", direct_copies=direct)
    items = copied(leader)
    for wrong in ([items[1]], [items[0], items[2]], [items[0], items[0]]):
        with pytest.raises(AtomlogError) as refused:
            follower.append_copied(wrong)
        assert refused.value.reason == "OFFSET_OUT_OF_RANGE"
        assert follower.log_end_offset == 0
    follower.append_copied(items[:1])
    with pytest.raises(AtomlogError):
        follower.append_copied(items[:1])  # a repeated fetch answer
    follower.append_copied(items[1:])
    follower.flush()
    assert stored_batches(follower) == stored_batches(leader)


def test_a_follower_cuts_back_and_takes_the_new_leaders_batches(tmp_path, direct):
    old = open_log(tmp_path / "old-leader")
    old.append([make_batch(2, key=b"a"), make_batch(2, key=b"b"), make_batch(2, key=b"x")])
    old.flush()
    follower = open_log(tmp_path / "follower", direct_copies=direct)
    follower.append_copied(copied(old))
    follower.flush()
    # The new leader has the first two batches, then its own from offset 4.
    new = open_log(tmp_path / "new-leader")
    new.append_copied(copied(old)[:2])
    new.append([make_batch(3, key=b"y")])
    new.flush()
    assert follower.truncate_to(4) == 4
    follower.append_copied(copied(new, 4))
    follower.flush()
    assert stored_batches(follower) == stored_batches(new)
    snapshot = crash_copy(follower, tmp_path / "crash")
    follower.close()
    for directory in (tmp_path / "follower", snapshot):
        reopened = open_log(directory)
        assert reopened.data_loss is None and stored_batches(reopened) == stored_batches(new)
        reopened.close()


def test_restart_at_the_leaders_log_start(tmp_path, direct):
    follower = open_log(tmp_path / "follower", segment_bytes=1_000, direct_copies=direct)
    follower.append([make_batch(2, 200)] * 6)
    follower.flush()
    leader = open_log(tmp_path / "leader", segment_bytes=1_000)
    leader.restart_at(40)
    assert (leader.log_start_offset, leader.log_end_offset, leader.high_watermark) == (40, 40, 40)
    leader.append([make_batch(3), make_batch(2)])
    leader.flush()
    # The follower ends (12) below the leader's log start (40): nothing to keep.
    follower.restart_at(40)
    assert (follower.log_start_offset, follower.log_end_offset) == (40, 40)
    assert [s.base_offset for s in follower.segments()] == [40]
    follower.append_copied(copied(leader))
    follower.flush()
    assert stored_batches(follower) == stored_batches(leader)
    snapshot = crash_copy(follower, tmp_path / "crash")
    follower.close()
    for directory in (tmp_path / "follower", snapshot):
        reopened = open_log(directory, segment_bytes=1_000)
        assert reopened.data_loss is None
        assert (reopened.log_start_offset, reopened.log_end_offset) == (40, 45)
        assert stored_batches(reopened) == stored_batches(leader)
        reopened.close()
    with pytest.raises(AtomlogError) as refused:
        leader.restart_at(-1)
    assert refused.value.reason == "INVALID_ARGUMENT"


# ------------------------------------------------------------------ writes around the page cache

def write_and_copy(leader, follower, batches: list[bytes]) -> None:
    """The leader appends `batches` and flushes; the follower copies what it lacks and
    flushes, as one replication round."""
    leader.append(batches)
    leader.flush()
    follower.append_copied(copied(leader, follower.log_end_offset))
    follower.flush()


@pytest.mark.parametrize("segment_bytes", [4_000_000, 300_000])
def test_direct_copies_pad_the_last_block_until_a_close_cuts_it(tmp_path, segment_bytes):
    """Direct writes are whole 4 KiB blocks from the file's last block boundary: while the
    follower writes, its file ends in zeros past the log's end; each append rewrites the
    partial block from memory; a close cuts the zeros off (so the next open trusts the
    clean shutdown), and so does a roll before it seals a segment."""
    leader = open_log(tmp_path / "leader", segment_bytes=segment_bytes)
    # Sizes that end mid-block, and one append of 1.8 MB: past the 1 MiB direct buffer.
    singles = [(1, 10), (3, 1_000), (40, 1_000), (300, 1_000), (5, 7)]
    for records, value_bytes in singles + [(600, 1_000)] * 3 + [(2, 3_000)]:
        leader.append([make_batch(records, value_bytes)])
        leader.flush()
    items = copied(leader)
    groups = [[item] for item in items[:len(singles)]] + [items[len(singles):-1], items[-1:]]
    follower = open_log(tmp_path / "follower", segment_bytes=segment_bytes, direct_copies=True)
    for group in groups:
        follower.append_copied(group)
        follower.flush()
        active = follower.segments()[-1]
        on_disk = os.path.getsize(active.path)
        assert on_disk % direct_io.BLOCK == 0 and 0 <= on_disk - active.size_bytes < direct_io.BLOCK
        for sealed in follower.segments()[:-1]:  # cut back to its size before it was sealed
            assert os.path.getsize(sealed.path) == sealed.size_bytes
        assert stored_batches(follower) == [b for b in stored_batches(leader)
                                            if b[0] < follower.log_end_offset]
    assert stored_batches(follower) == stored_batches(leader)
    follower.close()
    assert len(follower.segments()) == len(leader.segments())
    assert (len(leader.segments()) == 1) == (segment_bytes > 2_000_000)
    for segment in leader.segments():
        path = tmp_path / "follower" / os.path.basename(segment.path)
        assert path.read_bytes() == open(segment.path, "rb").read()
    reopened = open_log(tmp_path / "follower", segment_bytes=segment_bytes, direct_copies=True)
    assert reopened.recovery.clean_shutdown and reopened.recovery.truncated_bytes == 0
    assert stored_batches(reopened) == stored_batches(leader)
    reopened.close()


def test_a_crash_leaves_the_padding_to_recovery_and_loses_nothing_flushed(tmp_path):
    leader = open_log(tmp_path / "leader")
    follower = open_log(tmp_path / "follower", direct_copies=True)
    write_and_copy(leader, follower, [make_batch(7, 333), make_batch(2, 5)])
    padded = os.path.getsize(tmp_path / "follower" / f"{0:020d}.log")
    assert padded > follower.size_bytes
    # kill -9 now: the files as they are, zeros and all.
    snapshot = crash_copy(follower, tmp_path / "crash")
    reopened = open_log(snapshot, direct_copies=True)
    assert reopened.data_loss is None and not reopened.recovery.clean_shutdown
    assert reopened.recovery.truncated_bytes == padded - follower.size_bytes
    assert stored_batches(reopened) == stored_batches(leader)
    # It goes on copying where it ended.
    write_and_copy(leader, reopened, [make_batch(4, 900)])
    assert stored_batches(reopened) == stored_batches(leader)
    reopened.close()
    follower.close()


def test_a_promoted_follower_appends_its_own_batches_after_direct_copies(tmp_path):
    """A log that wrote copies around the page cache and then appends as a leader
    (buffered, O_APPEND) must not leave the padding between the two."""
    leader = open_log(tmp_path / "leader")
    follower = open_log(tmp_path / "follower", direct_copies=True)
    write_and_copy(leader, follower, [make_batch(3, 50)])
    assert follower.append([make_batch(2, 70)]) == [3]
    follower.flush()
    leader.append([make_batch(2, 70)])
    leader.flush()
    ours = stored_batches(follower)
    assert [base for base, _ in ours] == [0, 3]
    assert ours[0] == stored_batches(leader)[0]
    assert os.path.getsize(tmp_path / "follower" / f"{0:020d}.log") == follower.size_bytes
    follower.close()


# ------------------------------------------------------------------ leader-epoch file

def test_leader_epochs_persist_and_follow_the_log(tmp_path):
    from partition_server.leader_epochs import FILE_NAME, LeaderEpochFile

    epochs = LeaderEpochFile(tmp_path, log_start=0, log_end=0)
    assert epochs.cache.entries == []
    epochs.assign(1, 0)
    epochs.assign(3, 10)
    epochs.assign(3, 12)  # already known: no rewrite
    assert LeaderEpochFile(tmp_path, 0, 20).cache.entries == [(1, 0), (3, 10)]
    epochs.truncate_from_end(10)
    assert LeaderEpochFile(tmp_path, 0, 10).cache.entries == [(1, 0)]
    epochs.assign(4, 10)
    epochs.truncate_from_start(5)
    assert LeaderEpochFile(tmp_path, 5, 10).cache.entries == [(1, 5), (4, 10)]
    # A crash between cutting the log and the file: opening drops what lies past the end,
    # and an epoch begun exactly at the end (a leader that wrote nothing yet) stays.
    assert LeaderEpochFile(tmp_path, 5, 8).cache.entries == [(1, 5)]
    assert (tmp_path / FILE_NAME).read_bytes() == b"1\n1\n1 5\n"
    # Retention moved the log start past the first epoch while the file was not updated.
    epochs = LeaderEpochFile(tmp_path, 5, 8)
    epochs.assign(6, 8)
    assert LeaderEpochFile(tmp_path, 9, 9).cache.entries == [(6, 9)]


def test_an_unreadable_epoch_file_is_set_aside_and_forgotten(tmp_path):
    from partition_server.leader_epochs import FILE_NAME, LeaderEpochFile

    (tmp_path / FILE_NAME).write_bytes(b"1\n2\n1 0\n")  # says 2 entries, holds 1
    epochs = LeaderEpochFile(tmp_path, 0, 10)
    assert epochs.cache.entries == [] and epochs.set_aside is not None
    assert epochs.set_aside.read_bytes() == b"1\n2\n1 0\n"
    assert not (tmp_path / FILE_NAME).exists()
    epochs.assign(2, 10)
    assert LeaderEpochFile(tmp_path, 0, 10).cache.entries == [(2, 10)]


@pytest.fixture
def ramfs(tmp_path):
    """A real file system that refuses O_DIRECT (ramfs: EINVAL at open), mounted for the
    test; skipped where this process may not mount."""
    import subprocess

    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "none", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_file_system_without_o_direct_gets_buffered_copies(tmp_path, ramfs):
    leader = open_log(tmp_path / "leader")
    follower = open_log(ramfs / "follower", direct_copies=True)
    write_and_copy(leader, follower, [make_batch(5, 333), make_batch(2, 10)])
    assert os.path.getsize(ramfs / "follower" / f"{0:020d}.log") == follower.size_bytes
    write_and_copy(leader, follower, [make_batch(3, 70)])
    assert stored_batches(follower) == stored_batches(leader)
    follower.close()
    reopened = open_log(ramfs / "follower", direct_copies=True)
    assert reopened.recovery.clean_shutdown and stored_batches(reopened) == stored_batches(leader)
    reopened.close()


def test_a_follower_closed_while_it_reopens_its_log_leaves_the_log_closed(tmp_path):
    """A follower reopens its log after a failure in its fetcher's round; if the partition
    manager closes it meanwhile (a new leadership here), the log the reopen opens is closed
    again, so the directory's next owner can open it (before, it stayed open with nobody to
    close it: "open elsewhere" for every later open of the partition)."""
    import asyncio
    import threading
    import time

    from partition_server.log import LogConfig, PartitionLog
    from partition_server.manager import REPLICA_CHANNEL_OPTIONS
    from partition_server.replica import PARTITION_SERVICE, Follower, LeaderFetcher, ReplicaStub
    from services import local

    directory = tmp_path / "t-0"
    nowhere = "127.0.0.1:9"  # no leader answers: the fetcher's calls fail and back off

    async def scenario():
        stubs = local.StubCache(PARTITION_SERVICE, ReplicaStub, REPLICA_CHANNEL_OPTIONS)
        fetcher = LeaderFetcher("ps-x", nowhere, stubs, 100)
        follower = Follower("t", 0, directory, LogConfig(), "ps-x", "ps-y", nowhere, 1,
                            fetcher, incarnation=1)
        await follower.start()
        follower.retry_at = time.monotonic() + 60  # the fetcher's own rounds leave it be
        opening, release = threading.Event(), threading.Event()
        open_log_now = follower._open

        def open_when_released():
            opening.set()
            release.wait(10)
            return open_log_now()

        follower._open = open_when_released
        follower._reopen_due = True
        preparing = asyncio.ensure_future(follower.prepare())
        assert await asyncio.to_thread(opening.wait, 10)
        closing = asyncio.ensure_future(follower.close())
        await asyncio.sleep(0.1)
        release.set()
        prepared = await preparing
        await closing
        await fetcher.close()
        await stubs.close()
        return prepared

    prepared = asyncio.run(scenario())
    PartitionLog(directory, LogConfig()).close()  # nobody holds it
    assert prepared is None  # and the closed follower asked for nothing


@pytest.mark.parametrize("follower_epochs,follower_end,leader_epochs,leader_start,expected", [
    # The follower's epoch 3 the leader never had (its epoch 2 began at 8): cut to 12 only,
    # it kept asking about 3 (fixed 2026-12-06: cut to 10, then to 8 by epoch 1).
    ([(1, 0), (3, 10)], 20, [(1, 0), (2, 8), (4, 12)], 0, (8, 1)),
    # The leader deleted its log below 12, inside its epoch 2: it keeps no epoch as old as
    # the follower's 1 (NO_EPOCH). The follower restarts, empty, at 12 and asks about none.
    ([(1, 0)], 20, [(1, 0), (2, 8)], 12, (12, -1)),
    # Its log ends below the leader's start: OFFSET_OUT_OF_RANGE, a restart, then no epoch
    # (before, the restart kept epoch 1 from 12, which the next round's cut removed).
    ([(1, 0)], 6, [(1, 0), (2, 8)], 12, (12, -1)),
])
def test_a_follower_converges_on_its_leaders_history_in_a_few_rounds(
        tmp_path, follower_epochs, follower_end, leader_epochs, leader_start, expected):
    """The follower's own request and answer handling (replica.Follower.request and
    handle, on its real log and leader-epoch file), against answers made by the leader's
    rule (replica.LeaderReplication: OFFSET_OUT_OF_RANGE below its log start, else its
    own `_divergence` on the leader's epochs: the largest epoch it keeps at most the one
    asked about, and where it ends). It must reach a fetch the leader answers with
    records within a few rounds."""
    import asyncio

    from atomlog.v1 import partition_pb2
    from partition_server.leader_epochs import LeaderEpochFile
    from partition_server.log import LogConfig
    from partition_server.manager import REPLICA_CHANNEL_OPTIONS
    from types import SimpleNamespace

    from partition_server.replica import (PARTITION_SERVICE, Follower, LeaderFetcher,
                                          LeaderReplication, ReplicaStub)
    from partition_server.replication import LeaderEpochCache
    from services import local

    directory = tmp_path / "t-0"
    source = open_log(tmp_path / "source")
    source.append([make_batch(1, key=bytes([i])) for i in range(follower_end)])
    source.flush()
    follower_log = open_log(directory)
    follower_log.append_copied(copied(source))
    follower_log.flush()
    follower_log.close()
    epochs = LeaderEpochFile(directory, 0, follower_end)
    for epoch, start in follower_epochs:
        epochs.assign(epoch, start)
    leader = LeaderEpochCache(list(leader_epochs))
    leader.truncate_from_start(leader_start)
    leader_end = 30

    # The leader's own rule (LeaderReplication._divergence) on its epochs and log end.
    leader_state = SimpleNamespace(epochs=SimpleNamespace(cache=leader), log_end=leader_end)

    def answer(request):
        fetch, last = request.fetch_offset, request.last_fetched_epoch
        if fetch < leader_start:  # as LeaderReplication.begin_replicate refuses it
            return AtomlogError("OFFSET_OUT_OF_RANGE", f"{fetch} is below {leader_start}",
                                {"log_start_offset": str(leader_start)})
        diverging = LeaderReplication._divergence(leader_state, fetch, last)
        if diverging is None:
            return None  # answered with records from `fetch`
        epoch, end = diverging
        return partition_pb2.ReplicateResponse(
            high_watermark=leader_start, log_start_offset=leader_start,
            log_end_offset=leader_end, diverging=True, diverging_epoch=epoch,
            diverging_end_offset=end)

    async def scenario():
        stubs = local.StubCache(PARTITION_SERVICE, ReplicaStub, REPLICA_CHANNEL_OPTIONS)
        nowhere = "127.0.0.1:9"
        fetcher = LeaderFetcher("ps-x", nowhere, stubs, 100)
        follower = Follower("t", 0, directory, LogConfig(), "ps-x", "ps-y", nowhere, 5,
                            fetcher, incarnation=1, direct_io=False)
        await follower.start()
        try:
            for _ in range(5):
                request = follower.request()
                outcome = answer(request)
                if outcome is None:
                    return request.fetch_offset, request.last_fetched_epoch
                await follower.handle(request, outcome)
            raise AssertionError(f"still asking about epoch {request.last_fetched_epoch} "
                                 f"at {request.fetch_offset}")
        finally:
            await follower.close()
            await fetcher.close()
            await stubs.close()

    assert asyncio.run(scenario()) == expected
