"""DeleteRecords on the partition log and its owner, on real files: whole segments below
before_offset go (never the active one), the start offset survives a reopen, bad inputs
change nothing, and producer-state snapshots never describe deleted data."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

from partition_server import owner as owner_module
from partition_server.log import LogConfig, PartitionLog, unlink_files
from partition_server.owner import OwnerSettings, PartitionOwner
from partition_server.producer_state import ProducerStateTable, snapshot_file_name
from partition_server.record_batch import parse_header
from services.errors import AtomlogError
from tests.test_log import make_batch, open_log, segment_file, stored_batches


def filled_log(path, batches: int = 9) -> PartitionLog:
    log = open_log(path, segment_bytes=1_000)
    log.append([make_batch(2, 200)] * batches)  # 2 batches a segment: [0,4) [4,8) ... [16,18)
    log.flush()
    return log


def test_delete_records_deletes_whole_segments_below_and_survives_a_reopen(tmp_path):
    log = filled_log(tmp_path / "p")
    assert [s.base_offset for s in log.segments()] == [0, 4, 8, 12, 16]
    assert log.log_start_after_delete(10) == 8
    assert log.delete_records(10) == 8  # offset 10 is in [8,12): that segment stays
    assert [s.base_offset for s in log.segments()] == [8, 12, 16]
    assert not segment_file(log.directory, 4).exists()
    assert not segment_file(log.directory, 4).with_suffix(".index").exists()
    assert log.delete_records(10) == 8 and log.delete_records(3) == 8  # idempotent, no-op
    assert log.delete_records(12) == 12  # a segment boundary: [8,12) goes
    with pytest.raises(AtomlogError) as below:
        log.read(11, 100)
    assert below.value.reason == "OFFSET_OUT_OF_RANGE"
    assert stored_batches(log)[0][0] == 12
    log.close()
    reopened = open_log(tmp_path / "p", segment_bytes=1_000)
    assert reopened.log_start_offset == 12 and reopened.high_watermark == 18
    assert [h.base_offset for h in reopened.iter_headers()] == [12, 14, 16]
    reopened.append([make_batch(2, 200)])
    assert reopened.flush() == 20
    reopened.close()


def test_delete_records_never_deletes_the_active_segment_or_unflushed_data(tmp_path):
    log = filled_log(tmp_path / "p")
    assert log.delete_records(18) == 16  # == the high watermark: every sealed segment goes
    assert log.segment_count == 1
    log.append([make_batch(2, 200)] * 3)  # rolls: [16,20) sealed, [20,22) active, unflushed
    for bad, reason in ((19, "OFFSET_OUT_OF_RANGE"), (24, "OFFSET_OUT_OF_RANGE"),
                        (-1, "INVALID_ARGUMENT")):
        with pytest.raises(AtomlogError) as refused:
            log.delete_records(bad)
        assert refused.value.reason == reason
    assert log.log_start_offset == 16 and log.segment_count == 2
    assert refused_metadata(log, 30) == {"log_start_offset": "16", "high_watermark": "18"}
    log.flush()
    assert log.delete_records(22) == 20 and log.segment_count == 1
    log.close()
    assert open_log(tmp_path / "p", segment_bytes=1_000).log_start_offset == 20


def refused_metadata(log: PartitionLog, before_offset: int) -> dict:
    with pytest.raises(AtomlogError) as refused:
        log.delete_records(before_offset)
    return refused.value.metadata


def test_retention_still_shares_the_deletion_path(tmp_path):
    log = filled_log(tmp_path / "p")
    log.delete_records(4)
    log.config = LogConfig(segment_bytes=1_000, retention_bytes=1_500)
    # Sizes count down as segments go: [4,8) goes, then the rest would drop below 1,500 bytes.
    assert log.apply_retention() == 1 and log.log_start_offset == 8


def test_owner_removes_producer_snapshots_of_deleted_data_first(tmp_path):
    async def scenario():
        settings = OwnerSettings(log=LogConfig(segment_bytes=1_000), fsync=False)
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            batches = [make_batch(2, 200)] * 9
            results = await owner.produce([(b, parse_header(b)) for b in batches])
            assert [r.base_offset for r in results] == list(range(0, 18, 2))
            # Snapshots as the owner writes them, one describing deleted data, one not.
            for covered in (2, 10):
                (owner.directory / snapshot_file_name(covered)).write_bytes(
                    ProducerStateTable(10, 1_000).snapshot(covered))
            assert await owner.delete_records(10) == 8
            assert not (owner.directory / snapshot_file_name(2)).exists()
            assert (owner.directory / snapshot_file_name(10)).exists()
            with pytest.raises(AtomlogError) as too_far:
                await owner.delete_records(19)
            assert too_far.value.reason == "OFFSET_OUT_OF_RANGE"
            assert owner.positions()["log_start_offset"] == 8
        finally:
            await owner.close()
        reopened = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await reopened.start()
        try:
            assert reopened.positions()["log_start_offset"] == 8
            assert reopened.positions()["high_watermark"] == 18
        finally:
            await reopened.close()

    asyncio.run(scenario())


def test_deleted_segments_are_renamed_synced_and_unlinked_elsewhere(tmp_path):
    """A deleted segment's files are renamed to *.deleted before the directory's fsync,
    and unlinked by whoever `defer_unlink` names (the owner: a worker thread; freeing a
    large file's blocks holds the caller for tens of ms). A crash before the unlink
    leaves them to the next open, which removes them: the deleted data never returns."""
    log = filled_log(tmp_path / "p")
    handed: list = []
    log.defer_unlink = handed.append
    assert log.delete_records(10) == 8
    [doomed] = handed
    assert sorted(p.name for p in doomed) == sorted(
        f"{base:020d}.{kind}.deleted" for base in (0, 4) for kind in ("log", "index"))
    assert all(p.exists() for p in doomed)  # not unlinked here
    assert not segment_file(log.directory, 0).exists()
    crashed = tmp_path / "crash"
    shutil.copytree(log.directory, crashed)
    unlink_files(doomed)
    assert not any(p.exists() for p in doomed)
    log.close()
    reopened = open_log(crashed, segment_bytes=1_000)  # the crash copy: renamed, not unlinked
    assert reopened.log_start_offset == 8
    assert not list(crashed.glob("*.deleted"))
    reopened.truncate_to(10)  # a cut deletes the later segments: its reload unlinks them
    assert [s.base_offset for s in reopened.segments()] == [8]
    assert not list(crashed.glob("*.deleted"))
    reopened.close()


def test_the_owner_unlinks_deleted_segments_off_its_event_loop(tmp_path):
    """DeleteRecords (and retention, the same path) on an owner: the files are unlinked
    on a worker thread, not on the event loop every partition of the process shares."""
    settings = OwnerSettings(log=LogConfig(segment_bytes=1_000), fsync=False)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        loop_thread = threading.get_ident()
        unlinked_on: list[int] = []
        original = owner_module.unlink_files

        def watched(paths):
            unlinked_on.append(threading.get_ident())
            original(paths)

        owner_module.unlink_files = watched
        try:
            for _ in range(9):
                data = make_batch(2, 200)
                await owner.produce([(data, parse_header(data))])
            assert await owner.delete_records(10) == 8
            deadline = time.monotonic() + 10
            while list((tmp_path / "t-0").glob("*.deleted")):  # until the thread unlinked
                assert time.monotonic() < deadline, "the deleted files were never unlinked"
                await asyncio.sleep(0.01)
        finally:
            owner_module.unlink_files = original
        assert unlinked_on and loop_thread not in unlinked_on
        await owner.close()

    asyncio.run(scenario())


async def write_as(owner: PartitionOwner, producer_id: int, sequence: int):
    """Producer `producer_id`'s batch of two 200-byte records at `sequence`: its answer."""
    from partition_server.record_batch import Record, encode_batch

    b = encode_batch([Record(b"k", bytes(200)), Record(b"k", bytes(200))],
                     producer_id=producer_id, producer_epoch=0, base_sequence=sequence)
    return (await owner.produce([(b, parse_header(b))]))[0]


def test_a_producer_snapshot_older_than_the_log_start_is_not_restored(tmp_path):
    """Retention moved the log start past the newest producer snapshot (covering 4), and
    the server crashed before the next one. The load restored that snapshot and replayed
    from the new start, so producer 7's state was as of offset 4: its batch at 4-5 (in a
    deleted segment), retried after a lost answer, was appended a second time. Now
    retention removes such snapshots, and a load ignores one it still finds; the retry is
    refused as unknown (written nothing), never appended twice."""
    async def scenario():
        settings = OwnerSettings(log=LogConfig(segment_bytes=1_000, retention_bytes=1),
                                 fsync=False, snapshot_interval_batches=1 << 30,
                                 snapshot_interval_ms=1 << 30)
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            for sequence in (0, 2):
                await write_as(owner, 7, sequence)
            stale = owner.directory / snapshot_file_name(4)
            stale_bytes = owner.producers.snapshot(4)
            stale.write_bytes(stale_bytes)  # as the owner writes them
            await write_as(owner, 7, 4)  # producer 7's last batch, at 4-5
            for sequence in (0, 2, 4):
                await write_as(owner, 8, sequence)
            assert owner.log.log_end_offset == 12
            assert await owner.apply_retention() == 2
            assert owner.log.log_start_offset == 8
            assert not stale.exists()
            assert (await write_as(owner, 7, 4)).base_offset == 4  # live: a duplicate
            crashed = tmp_path / "crash" / "t-0"
            # (Not the snapshot a worker thread may be writing meanwhile: its temporary
            # file can go between copytree's listing and its copy, as seen in CI; the
            # snapshots are replaced below anyway.)
            shutil.copytree(owner.directory, crashed,
                            ignore=shutil.ignore_patterns("*.deleted", "*.tmp"))
        finally:
            await owner.close()
        # A crash before the removal (and so before the snapshot that follows the move,
        # test_a_moved_log_start_is_followed_by_a_snapshot_soon): the load still finds
        # the old snapshot, and no newer one.
        for path in crashed.iterdir():
            if path.suffix in (".producer_snapshot", ".txn_snapshot"):
                path.unlink()
        (crashed / snapshot_file_name(4)).write_bytes(stale_bytes)
        reopened = PartitionOwner("t", 0, crashed, settings)
        await reopened.start()
        try:
            refused = await write_as(reopened, 7, 4)
            assert isinstance(refused, AtomlogError), refused
            assert refused.reason == "UNKNOWN_PRODUCER_ID"
            assert reopened.log.log_end_offset == 12
        finally:
            await reopened.close()

    asyncio.run(scenario())


def _clocked(monkeypatch, retention_ms: int) -> tuple[list[int], OwnerSettings]:
    """The owners' wall clock made `now[0]`, and settings of 1,000-byte segments."""
    now = [1_800_000_000_000]
    monkeypatch.setattr(owner_module, "_wall_ms", lambda: now[0])
    return now, OwnerSettings(log=LogConfig(segment_bytes=1_000, retention_ms=retention_ms),
                              fsync=False)


async def _write_batches(owner, count: int) -> None:
    for _ in range(count):
        data = make_batch(2, 200)
        await owner.produce([(data, parse_header(data))])


def test_retention_ms_counts_from_now_on_a_partition_nobody_writes(tmp_path, monkeypatch):
    """The owner's retention pass measured a segment's age against the time of the last
    write (the owner's append clock), not the current time: on a topic nobody wrote any
    more, data past retention.ms was kept until the next write or restart. Now it counts
    from the wall clock."""
    now, settings = _clocked(monkeypatch, 60_000)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            await _write_batches(owner, 5)
            assert len(owner.log.segments()) == 3
            assert await owner.apply_retention() == 0  # nothing is old yet
            now[0] += 3_600_000  # an hour later, nothing written meanwhile
            assert await owner.apply_retention() == 2
            assert owner.log.log_start_offset == 8
        finally:
            await owner.close()

    asyncio.run(scenario())


def test_a_moved_log_start_is_followed_by_a_snapshot_soon(tmp_path):
    """DeleteRecords (and retention) remove the snapshots covering less than the new log
    start, and nothing took a new one until the interval's end: an idle partition could
    stay without any for hours. A crash then loaded no producer state, and producer 7's
    first batch (sequence 0, now deleted), retried after a lost answer, was appended a
    second time. Now a snapshot follows the move at the owner's next step."""
    settings = OwnerSettings(log=LogConfig(segment_bytes=1_000), fsync=False,
                             snapshot_interval_batches=1 << 30, snapshot_interval_ms=1 << 30)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            await write_as(owner, 7, 0)
            for sequence in (0, 2, 4):
                await write_as(owner, 8, sequence)
            start = await owner.delete_records(owner.log.high_watermark)
            assert start > 0
            for _ in range(200):  # the owner's next step
                if list(owner.directory.glob("*.producer_snapshot")) and owner._snapshot_write is None:
                    break
                await asyncio.sleep(0.01)
            assert (await write_as(owner, 7, 0)).base_offset == 0  # live: a duplicate
            crashed = tmp_path / "crash" / "t-0"
            shutil.copytree(owner.directory, crashed, ignore=shutil.ignore_patterns("*.deleted"))
            end = owner.log.log_end_offset
        finally:
            await owner.close()
        reopened = PartitionOwner("t", 0, crashed, settings)
        await reopened.start()
        try:
            retried = await write_as(reopened, 7, 0)
            assert not isinstance(retried, AtomlogError) and retried.base_offset == 0, retried
            assert reopened.log.log_end_offset == end  # not appended again
        finally:
            await reopened.close()

    asyncio.run(scenario())


def test_retention_ms_rolls_an_idle_active_segment_so_that_it_goes_too(tmp_path, monkeypatch):
    """Retention never deletes the active segment, and a roll by age happens on an
    append: on a topic nobody writes any more, its last segment (up to segment.bytes)
    outlived any retention.ms. Now a retention pass that finds it past retention has
    the owner roll it, and the next pass deletes it (as Kafka does)."""
    now, settings = _clocked(monkeypatch, 60_000)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            await _write_batches(owner, 5)
            end = owner.log.log_end_offset
            now[0] += 3_600_000
            assert await owner.apply_retention() == 2  # the sealed ones
            for _ in range(200):  # the owner task rolls the active one
                if owner.log.segments()[-1].base_offset == end and owner._roll is None:
                    break
                await asyncio.sleep(0.01)
            assert await owner.apply_retention() == 1
            assert owner.log.log_start_offset == end == owner.log.log_end_offset
            assert len(owner.log.segments()) == 1
            assert await owner.apply_retention() == 0  # an empty active segment stays
            data = make_batch(2, 200)
            assert (await owner.produce([(data, parse_header(data))]))[0].base_offset == end
        finally:
            await owner.close()

    asyncio.run(scenario())


def test_one_write_while_the_clock_ran_ahead_does_not_make_every_segment_old(
        tmp_path, monkeypatch):
    """Append times never go back (a clock set back keeps them ordered), and retention
    measured ages against that append clock: one write while the wall clock ran 8 days
    ahead (a bad RTC, a resumed VM) made every sealed segment 8 days old once the clock
    was set right, and retention (7 days) deleted minute-old data at once. Ages count to
    the wall clock now: a segment stamped ahead looks young, as in Kafka."""
    day = 86_400_000
    now, settings = _clocked(monkeypatch, 7 * day)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        try:
            await _write_batches(owner, 5)
            now[0] += 8 * day  # the clock runs ahead for one write
            data = make_batch(2, 200)
            await owner.produce([(data, parse_header(data))])
            now[0] -= 8 * day - 60_000  # set right: a minute after the first writes
            assert await owner.apply_retention() == 0
            assert owner.log.log_start_offset == 0
        finally:
            await owner.close()

    asyncio.run(scenario())
