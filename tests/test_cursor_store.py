"""The durable cursor store of a partition (partition_server/cursor_store.py), on real
files in tmp_path: recovery after writes, group commit, torn tails truncated, corruption
before the tail refused as DATA_LOSS, snapshot rotation and fallback, journal deletion,
bounds, snapshots in steps (a crash after each step, a failed step, close in between),
the shell (partition_server/subscriptions.py) writing a snapshot off the event loop while
acks go on, and a seeded random run of writes, snapshot steps and crashes checked against
the state at the last write."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from partition_server.cursor_store import (
    JOURNAL_HEADER_SIZE,
    CursorStore,
    CursorStoreLimits,
    StoreEntry,
    decode_payload,
    decode_store_snapshot,
    encode_frame,
    encode_journal_header,
    journal_file_name,
    parse_journal_file_name,
    parse_snapshot_file_name,
    snapshot_file_name,
)
from partition_server.record_batch import TxnId
from partition_server.snapshot_files import SnapshotCorrupt
from partition_server.subscription_cursor import (
    Acked,
    Created,
    CursorLimits,
    OffsetRange,
    PendingAck,
    TxnEnded,
)
from partition_server.subscriptions import PartitionSubscriptions
from services.errors import AtomlogError

T1, T2 = TxnId(3, 1), TxnId(3, 2)
LIMIT = 1_000


def states(store: CursorStore) -> dict:
    return {name: cursor.state() for name, cursor in store.cursors().items()}


def create(store: CursorStore, name: str, position: int = 0) -> None:
    entry = store.plan_create(name, position)
    assert entry is not None
    store.stage(entry)


def ack(store: CursorStore, name: str, cumulative_end: int = 0, ranges=(), txn=None) -> int:
    entry = store.cursor(name).check_ack(cumulative_end, ranges, txn, limit=LIMIT)
    assert entry is not None
    return store.stage(StoreEntry(name, entry))


def end(store: CursorStore, name: str, txn: TxnId, committed: bool) -> None:
    plan = store.cursor(name).plan_end_txn(txn, committed)
    store.stage(StoreEntry(name, plan.entry))


def reopen(store: CursorStore, limits: CursorStoreLimits | None = None) -> CursorStore:
    """kill -9 (what was written reached the page cache; staged entries are lost)."""
    store.close(sync=False)
    return CursorStore.open(store.directory, limits or store.limits)


def files(directory: Path, suffix: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(suffix))


def journal(directory: Path) -> Path:
    return directory / files(directory, ".cursor_journal")[-1]


def data_loss(directory: Path) -> AtomlogError:
    with pytest.raises(AtomlogError) as info:
        CursorStore.open(directory)
    assert info.value.reason == "DATA_LOSS"
    return info.value


@pytest.fixture
def store(tmp_path):
    store = CursorStore.open(tmp_path / "orders-0")
    yield store
    store.close(sync=False)


def busy(store: CursorStore) -> None:
    create(store, "billing")
    create(store, "audit", 5)
    ack(store, "billing", ranges=[(2, 4)])
    ack(store, "billing", ranges=[(6, 7)], txn=T1)
    ack(store, "audit", cumulative_end=9, txn=T2)
    ack(store, "audit", ranges=[(12, 13)])
    end(store, "audit", T2, committed=True)
    store.sync()


# ---------------------------------------------------------------------------------------
# Recovery and group commit
# ---------------------------------------------------------------------------------------

def test_a_fresh_directory_gets_an_empty_journal(tmp_path):
    store = CursorStore.open(tmp_path / "p")
    assert files(tmp_path / "p", "") == [journal_file_name(0)]
    assert (tmp_path / "p" / journal_file_name(0)).read_bytes() == encode_journal_header(0)
    assert (store.appended_end, store.durable_end, dict(store.cursors())) == (0, 0, {})
    store.close()


def test_recovery_replays_the_journal(store):
    busy(store)
    expected = states(store)
    assert expected["audit"].cumulative_end == 9
    assert expected["billing"].pending == (PendingAck(T1, 0, (OffsetRange(6, 7),)),)
    recovered = reopen(store)
    assert states(recovered) == expected
    assert (recovered.recovery.entries_replayed, recovered.appended_end,
            recovered.durable_end) == (7, 7, 7)
    ack(recovered, "billing", ranges=[(0, 2)])  # it goes on where it stopped
    recovered.sync()
    again = reopen(recovered)
    assert again.cursor("billing").cumulative_end == 4
    again.close()


def test_group_commit_moves_durable_end_and_staged_entries_are_lost_in_a_crash(store):
    create(store, "s")
    first = ack(store, "s", ranges=[(1, 2)])
    second = ack(store, "s", ranges=[(3, 4)])
    assert (first, second, store.appended_end, store.durable_end) == (1, 2, 3, 0)
    ticket = store.sync_begin()  # one write of all three frames
    assert ticket.target == 3 and store.durable_end == 0
    store.fsync(ticket)  # on a worker thread in the owner
    ack(store, "s", ranges=[(5, 6)])  # the owner goes on meanwhile
    store.sync_end(ticket)
    assert (store.durable_end, store.appended_end) == (3, 4)
    assert store.sync_begin() is not None  # the fourth is written, not yet synced
    # A no-op is answered once the journal is durable past what came before it.
    assert store.cursor("s").check_ack(ranges=[(5, 6)], limit=LIMIT) is None
    recovered = reopen(store)  # a process crash: the written frames are in the page cache
    assert recovered.cursor("s").individual_ranges() == (OffsetRange(1, 2), OffsetRange(3, 4),
                                                          OffsetRange(5, 6))
    ack(recovered, "s", ranges=[(7, 8)])  # staged only: a crash loses it
    assert reopen(recovered).cursor("s").individual_ranges()[-1] == OffsetRange(5, 6)


def test_forget_below_is_reapplied_after_recovery(store):
    busy(store)
    store.forget_below(10)
    assert store.cursor("billing").cumulative_end == 10
    expected = states(store)
    recovered = reopen(store)
    recovered.forget_below(10)  # the owner does this after every open
    assert states(recovered) == expected


# ---------------------------------------------------------------------------------------
# Torn tails and corruption
# ---------------------------------------------------------------------------------------

def _last_frame_start(path: Path) -> int:
    data = path.read_bytes()
    position, last = JOURNAL_HEADER_SIZE, JOURNAL_HEADER_SIZE
    while position < len(data):
        last = position
        position += 16 + int.from_bytes(data[position:position + 4], "little")
    return last


@pytest.mark.parametrize("damage", ["cut frame", "cut header", "bad crc", "zeros", "garbage"])
def test_a_torn_tail_is_truncated(store, damage):
    busy(store)
    expected = states(store)
    extra = ack(store, "billing", ranges=[(20, 25)])
    assert extra == 7
    store.sync()
    path = journal(store.directory)
    good_size = _last_frame_start(path)
    data = bytearray(path.read_bytes())
    store.close(sync=False)
    if damage == "cut frame":
        data = data[:-3]
    elif damage == "cut header":
        data = data[:good_size + 5]
    elif damage == "bad crc":
        data[-1] ^= 0xFF
    elif damage == "zeros":
        data = data[:good_size] + bytes(300)
    else:  # a length field pointing past the end of the file
        data = data[:good_size] + b"\xff\xff\x00\x00garbage"
    path.write_bytes(bytes(data))
    recovered = CursorStore.open(store.directory)
    assert states(recovered) == expected
    assert recovered.recovery.torn_bytes_truncated == len(data) - good_size
    assert path.stat().st_size == good_size
    ack(recovered, "billing", ranges=[(30, 31)])
    recovered.sync()
    again = reopen(recovered)
    assert again.cursor("billing").individual_ranges()[-1] == OffsetRange(30, 31)
    again.close()


def test_a_tail_whose_last_sectors_came_back_zeroed_is_truncated(store):
    """A power cut while more than a sector of frames was written but not synced: the
    first sectors come back and the rest read as zeros (the chaos harness's power
    nemesis models it so). The frame running into the zeros fails its CRC and ends
    before the end of the file. Before, that was DATA_LOSS (the subscriptions of the
    partition would not load until an operator acted); it is a torn tail, and nothing
    in it was acknowledged."""
    busy(store)
    expected = states(store)
    path = journal(store.directory)
    synced = path.stat().st_size
    for offset in range(40):  # well over a sector of frames, written, never synced
        ack(store, "billing", ranges=[(100 + 2 * offset, 101 + 2 * offset)])
    store.write()
    data = bytearray(path.read_bytes())
    store.close(sync=False)
    assert len(data) - synced > 3 * 512
    kept = (synced // 512 + 2) * 512  # the unsynced part's first sectors came back
    data[kept:] = bytes(len(data) - kept)
    path.write_bytes(bytes(data))
    recovered = CursorStore.open(store.directory)
    assert recovered.recovery.torn_bytes_truncated > 0
    assert synced <= path.stat().st_size <= kept
    survived = states(recovered)
    assert survived["audit"] == expected["audit"]
    before, after = expected["billing"], survived["billing"]
    assert after.cumulative_end == before.cumulative_end
    assert after.ranges[:len(before.ranges)] == \
        before.ranges  # what was synced, then a prefix of the unsynced acks
    assert (after.pending, after.ended) == (before.pending, before.ended)
    extra = after.ranges[len(before.ranges):]
    assert extra == tuple(OffsetRange(100 + 2 * i, 101 + 2 * i) for i in range(len(extra)))
    recovered.close()


def test_corruption_before_the_tail_is_data_loss(store):
    busy(store)
    store.close()
    path = journal(store.directory)
    data = bytearray(path.read_bytes())
    data[JOURNAL_HEADER_SIZE + 20] ^= 0x01  # inside the first frame's payload
    path.write_bytes(bytes(data))
    error = data_loss(store.directory)
    assert error.metadata == {"file": str(path), "position": str(JOURNAL_HEADER_SIZE)}
    assert "CRC32C mismatch" in error.message
    assert path.read_bytes() == bytes(data)  # nothing was truncated


def test_valid_frames_with_inconsistent_contents_are_data_loss(tmp_path):
    directory = tmp_path / "p"
    directory.mkdir()
    path = directory / journal_file_name(0)
    cases = {
        "creates an existing": [StoreEntry("a", Created(0)), StoreEntry("a", Created(1))],
        "changes an unknown": [StoreEntry("b", Acked(None, 3, ()))],
    }
    for message, items in cases.items():
        path.write_bytes(encode_journal_header(0) + b"".join(
            encode_frame(sequence, item) for sequence, item in enumerate(items)))
        assert message in data_loss(directory).message
    # A sequence gap, and a journal header naming another start.
    path.write_bytes(encode_journal_header(0) + encode_frame(1, StoreEntry("a", Created(0))))
    assert "expected 0" in data_loss(directory).message
    path.write_bytes(encode_journal_header(5))
    assert "starts at entry 5" in data_loss(directory).message


def test_a_journal_torn_while_being_created_is_replaced(store):
    busy(store)
    store.snapshot()
    name = journal_file_name(store.appended_end)
    store.close()
    (store.directory / name).write_bytes(encode_journal_header(7)[:9])
    recovered = CursorStore.open(store.directory)
    assert recovered.recovery.torn_bytes_truncated == 9
    assert (store.directory / name).read_bytes() == encode_journal_header(7)
    recovered.close()


def test_leftover_temporary_files_are_removed(store):
    busy(store)
    store.close()
    (store.directory / (snapshot_file_name(7) + ".tmp")).write_bytes(b"half a snapshot")
    CursorStore.open(store.directory).close()
    assert not files(store.directory, ".tmp")


# ---------------------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------------------

SMALL = CursorStoreLimits(max_subscriptions=3, snapshot_interval_entries=4,
                          max_journal_bytes=8 * 1024, cursor=CursorLimits(max_ranges=50))


def test_snapshots_rotate_journals_and_keep_two(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    create(store, "s")
    taken = []
    for offset in range(0, 40, 2):
        ack(store, "s", ranges=[(offset + 1, offset + 2)])
        store.sync()
        if store.maybe_snapshot():
            taken.append(store.durable_end)
            assert store.entries_since_snapshot == 0
    assert taken == [4, 8, 12, 16, 20]
    snapshots = [parse_snapshot_file_name(n) for n in files(store.directory, "_snapshot")]
    journals = [parse_journal_file_name(n) for n in files(store.directory, "_journal")]
    assert snapshots == [16, 20]
    assert journals == [16, 20]  # what the older snapshot needs, and the current one
    expected = states(store)
    recovered = reopen(store)
    assert states(recovered) == expected
    assert (recovered.recovery.snapshot_covered, recovered.recovery.entries_replayed) == (20, 1)
    covered, cursors = decode_store_snapshot(
        (store.directory / snapshot_file_name(20)).read_bytes())
    assert covered == 20 and list(cursors) == ["s"]
    recovered.close()


def test_a_single_snapshot_keeps_the_journals_from_the_start(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    assert store.snapshot() == 7
    assert store.snapshot() == 7  # nothing new: nothing written
    assert files(store.directory, "_journal") == [journal_file_name(0), journal_file_name(7)]
    expected = states(store)
    store.close()
    (store.directory / snapshot_file_name(7)).write_bytes(b"ALCS rubbish")
    recovered = CursorStore.open(store.directory)  # full replay from entry 0
    assert states(recovered) == expected and recovered.recovery.snapshot_covered is None
    assert recovered.recovery.corrupt_snapshots[0].startswith(snapshot_file_name(7))
    recovered.close()


def test_a_corrupt_newest_snapshot_falls_back_to_the_older_one(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    store.snapshot()
    ack(store, "billing", ranges=[(40, 41)])
    end(store, "billing", T1, committed=False)
    store.snapshot()
    ack(store, "audit", ranges=[(50, 51)])
    store.sync()
    expected = states(store)
    store.close()
    newest = store.directory / snapshot_file_name(9)
    data = bytearray(newest.read_bytes())
    data[30] ^= 0x10
    newest.write_bytes(bytes(data))
    recovered = CursorStore.open(store.directory)
    assert states(recovered) == expected
    assert recovered.recovery.snapshot_covered == 7
    assert recovered.recovery.entries_replayed == 3
    recovered.close()


def test_no_usable_snapshot_and_no_journal_from_the_start_is_data_loss(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    for _ in range(2):
        store.snapshot()
        ack(store, "billing", ranges=[(store.appended_end + 40, store.appended_end + 41)])
    store.snapshot()
    store.close()
    for name in files(store.directory, "_snapshot"):
        (store.directory / name).write_bytes(b"broken")
    error = data_loss(store.directory)
    assert "no snapshot is readable" in error.message


def test_a_missing_journal_is_data_loss(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    store.snapshot()
    ack(store, "billing", ranges=[(40, 41)])
    store.snapshot()
    store.close()
    os.remove(store.directory / journal_file_name(7))
    (store.directory / snapshot_file_name(8)).write_bytes(b"broken")
    assert "entries from 7 are missing" in data_loss(store.directory).message
    # And journals but for the snapshot's file gone: the store refuses too.
    os.remove(store.directory / snapshot_file_name(8))
    for name in files(store.directory, "_journal"):
        os.remove(store.directory / name)
    assert "no journal file" in data_loss(store.directory).message


def test_snapshot_decoding_refuses_damage(store):
    busy(store)
    store.snapshot()
    data = (store.directory / snapshot_file_name(7)).read_bytes()
    for index in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[index] ^= 0x04
        with pytest.raises(SnapshotCorrupt):
            decode_store_snapshot(bytes(flipped))
    with pytest.raises(SnapshotCorrupt):
        decode_store_snapshot(data[:-5])


# ---------------------------------------------------------------------------------------
# Snapshots in steps (the shell runs rotate and write_snapshot on worker threads)
# ---------------------------------------------------------------------------------------

def crash_copy(store: CursorStore, to: Path) -> Path:
    """The directory as kill -9 would leave it now (what was written is in the page
    cache); the store goes on."""
    shutil.copytree(store.directory, to)
    return to


def recovered_states(directory: Path) -> tuple[dict, int | None]:
    recovered = CursorStore.open(directory, SMALL)
    result = states(recovered), recovered.recovery.snapshot_covered
    recovered.close()
    return result


def spoil_newest_snapshot(directory: Path) -> None:
    newest = files(directory, "_snapshot")[-1]
    (directory / newest).write_bytes(b"ALCS spoilt")


def test_a_crash_after_any_snapshot_step_recovers_what_was_written(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    assert store.snapshot() == 7  # the older snapshot a fallback uses
    ack(store, "billing", ranges=[(40, 41)])  # staged: snapshot_begin writes it
    seen = {}

    def crash(step: str, written: dict) -> None:
        copy = crash_copy(store, tmp_path / step)
        state, covered = recovered_states(copy)
        assert state == written, step
        seen[step] = covered
        spoil_newest_snapshot(copy)  # whichever snapshot is newest readable
        assert recovered_states(copy)[0] == written, step

    job = store.snapshot_begin()
    assert (job.covered, store.snapshot_in_flight, store.snapshot_due()) == (8, True, False)
    written = states(store)
    crash("begin", written)
    store.rotate(job)  # a worker thread in the shell
    crash("rotate", written)
    torn = crash_copy(store, tmp_path / "torn")  # the new journal's creation torn
    (torn / journal_file_name(8)).write_bytes(encode_journal_header(8)[:5])
    assert recovered_states(torn)[0] == written
    store.rotate_end(job)
    assert (store.durable_end, store.journal_bytes) == (8, JOURNAL_HEADER_SIZE)
    # Group commits go on in the new journal while the snapshot is being written.
    ack(store, "audit", ranges=[(60, 61)])
    end(store, "billing", T1, committed=False)
    store.sync()
    written = states(store)
    ack(store, "audit", ranges=[(70, 71)])  # staged only: a crash loses it
    crash("journaled", written)
    half = crash_copy(store, tmp_path / "half")  # a crash inside write_snapshot
    (half / (snapshot_file_name(8) + ".tmp")).write_bytes(b"ALCS half a snap")
    assert recovered_states(half) == (written, 7)
    store.sync()
    written = states(store)
    store.write_snapshot(job)  # a worker thread in the shell
    assert job.written
    crash("write_snapshot", written)
    store.snapshot_end(job)
    crash("snapshot_end", written)
    assert seen == {"begin": 7, "rotate": 7, "journaled": 7, "write_snapshot": 8,
                    "snapshot_end": 8}
    assert files(store.directory, "_journal") == [journal_file_name(7), journal_file_name(8)]
    recovered = reopen(store)
    assert states(recovered) == written
    assert (recovered.recovery.snapshot_covered, recovered.recovery.entries_replayed) == (8, 3)
    recovered.close()


def test_no_journal_write_while_rotating_and_one_snapshot_at_a_time(store):
    busy(store)
    job = store.snapshot_begin()
    ack(store, "billing", ranges=[(40, 41)])  # staging goes on
    with pytest.raises(AssertionError, match="rotated"):
        store.sync_begin()
    with pytest.raises(AssertionError, match="one snapshot job"):
        store.snapshot_begin()
    store.rotate(job)
    store.rotate_end(job)
    assert store.sync() == 8 and not store.snapshot_due()
    store.write_snapshot(job)
    store.snapshot_end(job)
    assert store.snapshot() == 8 and store.snapshot() == 8  # nothing new: no job


def test_a_failed_rotation_breaks_the_store_and_reopening_recovers(store):
    busy(store)
    ack(store, "billing", ranges=[(40, 41)])
    # The disk refuses the new journal: its name is taken.
    (store.directory / journal_file_name(8)).write_bytes(b"")
    job = store.snapshot_begin()
    written = states(store)
    with pytest.raises(FileExistsError):
        store.rotate(job)
    store.rotate_end(job)
    store.snapshot_end(job)
    error = _refused(store.stage, StoreEntry("billing", Acked(None, 0, (OffsetRange(50, 51),))))
    assert error.reason == "INTERNAL" and "new journal" in error.message
    recovered = reopen(store)  # the empty file counts as a journal torn while created
    assert states(recovered) == written
    assert recovered.snapshot() == 8
    recovered.close()


def test_a_failed_snapshot_write_breaks_the_store_and_reopening_recovers(store):
    busy(store)
    job = store.snapshot_begin()
    store.rotate(job)
    store.rotate_end(job)
    ack(store, "audit", ranges=[(60, 61)])
    store.sync()
    written = states(store)
    # The disk refuses the snapshot: the name of its temporary file is taken.
    blocker = store.directory / (snapshot_file_name(7) + ".tmp")
    blocker.mkdir()
    with pytest.raises(IsADirectoryError):
        store.write_snapshot(job)
    store.snapshot_end(job)
    blocker.rmdir()
    assert not job.written
    assert _refused(store.sync).reason == "INTERNAL"
    recovered = reopen(store)
    assert states(recovered) == written
    assert recovered.recovery.snapshot_covered is None  # a full replay: journals 0 and 7
    recovered.close()


@pytest.mark.parametrize("closed_after", ["begin", "rotate_end"])
def test_closing_during_a_snapshot_abandons_its_file_work(tmp_path, closed_after):
    store = CursorStore.open(tmp_path / "p", SMALL)
    busy(store)
    ack(store, "billing", ranges=[(40, 41)])
    job = store.snapshot_begin()
    written = states(store)
    if closed_after == "rotate_end":
        store.rotate(job)
        store.rotate_end(job)
    store.close()  # the owner stops: rotate / write_snapshot then do nothing
    if closed_after == "begin":
        store.rotate(job)
        store.rotate_end(job)  # releases the descriptors the job owned
    store.write_snapshot(job)
    store.snapshot_end(job)
    assert not job.written and not files(store.directory, "_snapshot")
    journals = [journal_file_name(0)] + ([journal_file_name(8)]
                                         if closed_after == "rotate_end" else [])
    assert files(store.directory, "_journal") == journals
    assert recovered_states(store.directory) == (written, None)


# ---------------------------------------------------------------------------------------
# The shell: snapshots off the event loop
# ---------------------------------------------------------------------------------------

SHELL = CursorStoreLimits(snapshot_interval_entries=4, max_journal_bytes=8 * 1024)


def gate(store: CursorStore, fail: bool = False):
    """Hold the store's snapshot file write (a worker thread in the shell) until released;
    fail=True: then the disk refuses it (a real OSError: its temporary name is taken)."""
    entered, release = threading.Event(), threading.Event()
    write_snapshot = store.write_snapshot

    def gated(job):
        entered.set()
        assert release.wait(60)
        if not fail:
            return write_snapshot(job)
        blocker = store.directory / (snapshot_file_name(job.covered) + ".tmp")
        blocker.mkdir()
        try:
            return write_snapshot(job)
        finally:
            blocker.rmdir()

    store.write_snapshot = gated
    return entered, release


async def acks(subscriptions: PartitionSubscriptions, offsets) -> None:
    for offset in offsets:
        await subscriptions.ack("s", 0, [(offset, offset + 1)], None, 1_000)


async def shell(directory: Path) -> PartitionSubscriptions:
    subscriptions = PartitionSubscriptions("t-0", directory, SHELL, lambda: 0)
    await asyncio.to_thread(subscriptions.open, 0)
    await subscriptions.create("s", 0)  # EARLIEST of [0, 1,000)
    return subscriptions


async def settled(subscriptions: PartitionSubscriptions, store: CursorStore,
                  reopened: bool = False) -> None:
    """Until the snapshot job ended (and the shell reopened its store, if asked)."""
    for _ in range(3_000):
        if not store.snapshot_in_flight and (
                subscriptions.store not in (None, store) if reopened else True):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the snapshot never ended")


def test_the_shell_writes_a_snapshot_off_the_loop_while_acks_go_on(tmp_path):
    async def scenario():
        subscriptions = await shell(tmp_path / "cursors")
        store = subscriptions.store
        entered, release = gate(store)
        await acks(subscriptions, [1, 3, 5])  # the fourth entry: a snapshot is due
        assert await asyncio.to_thread(entered.wait, 60)  # its file write is held
        assert store.snapshot_in_flight and store.durable_end == 4
        await acks(subscriptions, range(7, 40, 2))  # answered meanwhile: the loop is free
        written = states(store)
        copy = crash_copy(store, tmp_path / "crash")  # kill -9 during the write
        assert recovered_states(copy) == (written, None)
        release.set()
        await settled(subscriptions, store)
        assert files(store.directory, "_snapshot")[0] == snapshot_file_name(4)
        subscriptions.close()
        recovered = CursorStore.open(store.directory, SHELL)
        assert states(recovered) == written and recovered.recovery.snapshot_covered >= 4
        recovered.close()

    asyncio.run(scenario())


def test_a_failed_snapshot_write_in_the_shell_reopens_the_store(tmp_path):
    async def scenario():
        subscriptions = await shell(tmp_path / "cursors")
        store = subscriptions.store
        entered, release = gate(store, fail=True)
        await acks(subscriptions, [1, 3, 5])
        assert await asyncio.to_thread(entered.wait, 60)
        await acks(subscriptions, [7, 9])
        written = states(store)
        release.set()
        await settled(subscriptions, store, reopened=True)  # from what is durable
        assert subscriptions.store is not store and subscriptions.error is None
        assert states(subscriptions.store) == written
        assert not files(store.directory, ".tmp")
        await acks(subscriptions, [11])  # and it goes on
        assert subscriptions.store.cursor("s").individual_ranges()[-1] == OffsetRange(11, 12)
        subscriptions.close()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------
# Bounds and errors
# ---------------------------------------------------------------------------------------

def test_subscription_bound_names_and_existing_ones(tmp_path):
    store = CursorStore.open(tmp_path / "p", SMALL)
    for name in ("a", "b", "c"):
        create(store, name)
    assert store.plan_create("a", 99) is None  # exists: unchanged
    error = _refused(store.plan_create, "d", 0)
    assert (error.reason, error.metadata) == ("RESOURCE_EXHAUSTED",
                                              {"limit": "partition.max_subscriptions"})
    for bad in ("", "a/b", "x" * 250, ".."):
        assert _refused(store.plan_create, bad, 0).reason == "INVALID_ARGUMENT"
    assert _refused(store.plan_delete, "zz").reason == "UNKNOWN_SUBSCRIPTION"
    assert _refused(store.cursor, "zz").reason == "UNKNOWN_SUBSCRIPTION"
    ack(store, "a", ranges=[(1, 2)], txn=T1)
    assert _refused(store.plan_delete, "a").reason == "TRANSACTION_CONFLICT"
    store.stage(store.plan_delete("b"))
    create(store, "d", 4)  # room again
    store.sync()
    recovered = reopen(store)
    assert sorted(recovered.cursors()) == ["a", "c", "d"]
    assert recovered.cursor("d").cumulative_end == 4
    recovered.close()


def test_journal_bytes_force_a_snapshot_and_bound_the_journal(tmp_path):
    limits = CursorStoreLimits(snapshot_interval_entries=1_000_000, max_journal_bytes=8 * 1024)
    store = CursorStore.open(tmp_path / "p", limits)
    create(store, "s")
    ranges = [(2 * i + 1, 2 * i + 2) for i in range(40)]  # ~650 bytes per entry
    while not store.snapshot_due():
        store.stage(StoreEntry("s", Acked(None, 0, tuple(OffsetRange(*r) for r in ranges))))
    assert store.journal_bytes >= limits.max_journal_bytes
    while store.journal_bytes <= 2 * limits.max_journal_bytes:
        store.stage(StoreEntry("s", Acked(None, 0, (OffsetRange(1, 2),))))
    error = _refused(store.stage, StoreEntry("s", Acked(None, 0, (OffsetRange(1, 2),))))
    assert (error.reason, error.metadata) == ("RESOURCE_EXHAUSTED",
                                              {"limit": "subscription.max_journal_bytes"})
    assert store.maybe_snapshot()
    assert store.journal_bytes == JOURNAL_HEADER_SIZE
    store.stage(StoreEntry("s", Acked(None, 0, (OffsetRange(1, 2),))))
    store.close()


def test_a_failed_write_breaks_the_store_until_it_is_reopened(store):
    busy(store)
    ack(store, "billing", ranges=[(30, 31)])
    ticket = store.sync_begin()
    store.fsync(ticket)
    store.sync_end(ticket)
    # The disk fails: the journal's descriptor now refuses writes.
    read_only = os.open(journal(store.directory), os.O_RDONLY)
    os.dup2(read_only, ticket.fd)
    os.close(read_only)
    ack(store, "billing", ranges=[(40, 41)])
    with pytest.raises(OSError):
        store.write()
    error = _refused(store.stage, StoreEntry("billing", Acked(None, 0, (OffsetRange(50, 51),))))
    assert error.reason == "INTERNAL" and "reopen it" in error.message
    assert _refused(store.sync).reason == "INTERNAL"
    recovered = reopen(store)  # the cursors in memory were ahead of the disk
    assert recovered.cursor("billing").individual_ranges() == (OffsetRange(2, 4),
                                                                OffsetRange(30, 31))
    recovered.close()


def test_frames_round_trip():
    item = StoreEntry("orders.v2-x_y", TxnEnded(T1, True))
    frame = encode_frame(42, item)
    assert decode_payload(frame[16:]) == item


def _refused(call, *args, **kwargs) -> AtomlogError:
    with pytest.raises(AtomlogError) as info:
        call(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------
# Seeded random run
# ---------------------------------------------------------------------------------------

def test_random_writes_snapshots_and_crashes_recover_the_synced_state(tmp_path):
    """Snapshots go step by step (snapshot_begin, rotate, rotate_end, write_snapshot,
    snapshot_end: one step per action), with writes, group commits and crashes between
    any two steps. `synced` is what a kill -9 keeps: every entry written to the journal
    (by a sync, or by snapshot_begin)."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")  # replay: set seed to this value
    rng = random.Random(seed)
    limits = CursorStoreLimits(max_subscriptions=4, snapshot_interval_entries=7,
                               max_journal_bytes=16 * 1024,
                               cursor=CursorLimits(max_ranges=20, max_pending_transactions=3))
    store = CursorStore.open(tmp_path / "p", limits)
    synced = states(store)
    txns = [TxnId(1, n) for n in range(1, 6)]
    job, steps_done = None, 0  # steps after snapshot_begin: rotate, rotate_end, write, end
    snapshots = crashes_mid_snapshot = 0

    def snapshot_step() -> None:
        nonlocal job, steps_done, synced, snapshots
        if job is None:
            if store.snapshot_due():
                job, steps_done = store.snapshot_begin(), 0
                synced = states(store)  # it wrote the staged frames
                snapshots += job is not None
            return
        step = (store.rotate, store.rotate_end, store.write_snapshot, store.snapshot_end)
        step[steps_done](job)
        steps_done += 1
        if steps_done == len(step):
            job = None

    def crash() -> None:
        """close without a sync; the job's remaining steps find it abandoned (the shell's
        worker threads would finish them so)."""
        nonlocal job, crashes_mid_snapshot
        store.close(sync=False)
        if job is not None:
            crashes_mid_snapshot += 1
            if steps_done < 2:
                store.rotate_end(job)
            store.snapshot_end(job)
            job = None

    for _ in range(400):
        action = rng.random()
        names = sorted(store.cursors())
        rotating = job is not None and steps_done < 2  # no journal write until rotate_end
        try:
            if action < 0.08 or not names:
                entry = store.plan_create(rng.choice("abcde"), rng.randrange(5))
                if entry is not None:
                    store.stage(entry)
            elif action < 0.11:
                store.stage(store.plan_delete(rng.choice(names)))
            elif action < 0.55:
                name, start = rng.choice(names), rng.randrange(60)
                txn = rng.choice(txns) if rng.random() < 0.4 else None
                cumulative_end = rng.randrange(60) if rng.random() < 0.2 else 0
                entry = store.cursor(name).check_ack(cumulative_end, [(start, start + 2)], txn,
                                                     limit=LIMIT)
                if entry is not None:
                    store.stage(StoreEntry(name, entry))
            elif action < 0.67:
                name = rng.choice(names)
                plan = store.cursor(name).plan_end_txn(rng.choice(txns), rng.random() < 0.5)
                if plan.entry is not None:
                    store.stage(StoreEntry(name, plan.entry))
            elif action < 0.77:
                if not rotating:
                    store.sync()
                    synced = states(store)
            elif action < 0.95:
                snapshot_step()
            elif action < 0.98 or rotating:
                crash()
                store = CursorStore.open(store.directory, limits)
                assert states(store) == synced
            else:
                store.sync()
                synced = states(store)
                crash()
                path = journal(store.directory)
                with open(path, "ab") as handle:  # a torn write of the next frames
                    handle.write(os.urandom(rng.randrange(1, 40)))
                store = CursorStore.open(store.directory, limits)
                assert states(store) == synced
        except AtomlogError as error:
            assert error.reason in ("TRANSACTION_CONFLICT", "RESOURCE_EXHAUSTED",
                                    "TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED",
                                    "TRANSACTION_ALREADY_COMMITTED"), error
    while job is not None:
        snapshot_step()
    store.sync()
    synced = states(store)
    store = reopen(store)
    assert states(store) == synced
    # A crash after a rotation leaves one more journal until snapshots are written; two
    # in a row leave the journals of the two snapshots kept, nothing else.
    covered = []
    for sequence in (1, 2):
        name = min(store.cursors(), default=None)
        store.stage(store.plan_create("z", 0) if name is None else StoreEntry(
            name, store.cursor(name).plan_end_txn(TxnId(9, sequence), True).entry))
        covered.append(store.snapshot())
    assert files(store.directory, "_snapshot") == [snapshot_file_name(c) for c in covered]
    assert files(store.directory, "_journal") == [journal_file_name(c) for c in covered]
    synced = states(store)
    assert states(reopen(store)) == synced
    print(f"{snapshots} snapshots, {crashes_mid_snapshot} crashes during one")
