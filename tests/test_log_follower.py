"""A follower's storage (docs/replication.md): copying the leader's batches byte for byte
at their offsets, cutting back by leader epoch, and restarting at the leader's log start —
on real files, checked against the leader's log and across reopen and crash copies."""

from __future__ import annotations

import pytest

from partition_server.record_batch import parse_header
from services.errors import AtomlogError
from tests.test_log import Clock, crash_copy, make_batch, open_log, stored_batches


def copied(leader, from_offset: int = 0) -> list[tuple[bytes, object]]:
    """What a Replicate answer carries: the leader's flushed batches from `from_offset`."""
    return [(batch, parse_header(batch)) for base, batch in stored_batches(leader)
            if base >= from_offset]


def test_copied_batches_keep_the_leaders_offsets_times_and_bytes(tmp_path):
    leader = open_log(tmp_path / "leader", Clock(1_000_000), segment_bytes=1_200)
    leader.append([make_batch(3, 200), make_batch(1, 200)])
    leader.flush()
    leader.append([make_batch(4, 200)] * 3)
    leader.flush()
    # The follower's clock is behind the leader's: copies keep the leader's times anyway.
    follower = open_log(tmp_path / "follower", Clock(5), segment_bytes=1_200)
    items = copied(leader)
    assert follower.append_copied(items[:2]) == [0, 3]
    assert follower.append_copied(items[2:]) == [4, 8, 12]
    follower.flush()
    assert stored_batches(follower) == stored_batches(leader)
    assert follower.log_end_offset == leader.log_end_offset == 16
    assert len(follower.segments()) > 1  # rolled by its own segment size
    follower.close()
    reopened = open_log(tmp_path / "follower", Clock(5), segment_bytes=1_200)
    assert stored_batches(reopened) == stored_batches(leader) and reopened.data_loss is None
    # The follower appends its own batches after the copies, as a new leader does.
    assert reopened.append([make_batch(2)]) == [16]
    reopened.flush()
    assert parse_header(stored_batches(reopened)[-1][1]).log_append_time_ms >= 1_000_000


def test_a_gap_or_overlap_is_refused_and_writes_nothing(tmp_path):
    leader = open_log(tmp_path / "leader")
    leader.append([make_batch(2), make_batch(3), make_batch(1)])
    leader.flush()
    follower = open_log(tmp_path / "follower")
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


def test_a_follower_cuts_back_and_takes_the_new_leaders_batches(tmp_path):
    old = open_log(tmp_path / "old-leader")
    old.append([make_batch(2, key=b"a"), make_batch(2, key=b"b"), make_batch(2, key=b"x")])
    old.flush()
    follower = open_log(tmp_path / "follower")
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


def test_restart_at_the_leaders_log_start(tmp_path):
    follower = open_log(tmp_path / "follower", segment_bytes=1_000)
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
