"""The durable cursor store of a partition (partition_server/cursor_store.py), on real
files in tmp_path: recovery after writes, group commit, torn tails truncated, corruption
before the tail refused as DATA_LOSS, snapshot rotation and fallback, journal deletion,
bounds, and a seeded random run of writes, snapshots and crashes checked against the
state at the last sync."""

from __future__ import annotations

import os
import random
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
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")  # replay: set seed to this value
    rng = random.Random(seed)
    limits = CursorStoreLimits(max_subscriptions=4, snapshot_interval_entries=7,
                               max_journal_bytes=16 * 1024,
                               cursor=CursorLimits(max_ranges=20, max_pending_transactions=3))
    store = CursorStore.open(tmp_path / "p", limits)
    synced = states(store)
    txns = [TxnId(1, n) for n in range(1, 6)]
    for _ in range(300):
        action = rng.random()
        names = sorted(store.cursors())
        try:
            if action < 0.08 or not names:
                entry = store.plan_create(rng.choice("abcde"), rng.randrange(5))
                if entry is not None:
                    store.stage(entry)
            elif action < 0.11:
                store.stage(store.plan_delete(rng.choice(names)))
            elif action < 0.65:
                name, start = rng.choice(names), rng.randrange(60)
                txn = rng.choice(txns) if rng.random() < 0.4 else None
                cumulative_end = rng.randrange(60) if rng.random() < 0.2 else 0
                entry = store.cursor(name).check_ack(cumulative_end, [(start, start + 2)], txn,
                                                     limit=LIMIT)
                if entry is not None:
                    store.stage(StoreEntry(name, entry))
            elif action < 0.8:
                name = rng.choice(names)
                plan = store.cursor(name).plan_end_txn(rng.choice(txns), rng.random() < 0.5)
                if plan.entry is not None:
                    store.stage(StoreEntry(name, plan.entry))
            elif action < 0.9:
                store.sync()
                synced = states(store)
                store.maybe_snapshot()
            elif action < 0.95:
                store = reopen(store)
                assert states(store) == synced
            else:
                store.sync()
                synced = states(store)
                store.close()
                path = journal(store.directory)
                with open(path, "ab") as handle:  # a torn write of the next frames
                    handle.write(os.urandom(rng.randrange(1, 40)))
                store = CursorStore.open(store.directory, limits)
                assert states(store) == synced
        except AtomlogError as error:
            assert error.reason in ("TRANSACTION_CONFLICT", "RESOURCE_EXHAUSTED",
                                    "TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED",
                                    "TRANSACTION_ALREADY_COMMITTED"), error
    store.sync()
    synced = states(store)
    assert states(reopen(store)) == synced
    assert len(files(store.directory, "_snapshot")) <= 2
    assert len(files(store.directory, "_journal")) <= 3
