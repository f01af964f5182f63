"""The write-ahead file (partition_server/wal.py, partition.durability=wal).

Its pure parts: frames and their valid prefix, the plan replay follows (appends, cuts and
bases in order), and which segments may go. Then partition owners on a real write-ahead
file and real partition files, crashed at random points with what a power cut may leave:
every partition file cut back to anywhere at or above what its last checkpoint made
durable, the write-ahead file cut back to anywhere at or above its last answered round.
After the replay, every acknowledged batch is there once, at the offset it was
acknowledged with, and nothing else but batches that were sent. Also: a cut is framed
before it is made, a failed checkpoint reloads its partition from the frames, and the
segments below every checkpoint go."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import re
import shutil
import threading
from pathlib import Path

import pytest

from partition_server import durability
from partition_server import owner as owner_module
from partition_server import wal as wal_module
from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.record_batch import Record, encode_batch, iter_batches, parse_header
from partition_server.record_batch import TxnId as PartitionTxnId
from partition_server.subscription_cursor import PendingAck
from partition_server.wal import (BASE, CUT, DATA, PAGE_BYTES, Plan, SegmentLedger,
                                  WriteAheadLog, decode_frames, encode_frame, list_segments,
                                  padding, plan)
from services.errors import AtomlogError


def batch(producer_id: int, sequence: int, value: bytes = b"v" * 40, count: int = 2) -> bytes:
    return encode_batch([Record(b"k", value)] * count, producer_id=producer_id,
                        producer_epoch=0, base_sequence=sequence, timestamp_ms=1_000)


async def produce_run(owner: PartitionOwner, start: int, end: int) -> None:
    """Producer 1's batches of two records from sequence `start` to `end`, one at a time."""
    for sequence in range(start, end, 2):
        b = batch(1, sequence)
        await owner.produce([(b, parse_header(b))])


def stamped(b: bytes, base_offset: int) -> bytes:
    """`b` as a log writes it at `base_offset` (the prefix stamped)."""
    from partition_server.record_batch import PREFIX, PREFIX_SIZE
    header = parse_header(b)
    return PREFIX.pack(base_offset, header.batch_length, header.magic, 5) + b[PREFIX_SIZE:]


# ---------------------------------------------------------------------------- pure core
def test_frames_round_trip_and_a_torn_or_damaged_frame_ends_the_valid_prefix():
    frames = [encode_frame(DATA, "t-0", 0, stamped(batch(1, 0), 0)),
              encode_frame(CUT, "t-1", 7),
              encode_frame(BASE, "__txn_log-3", 12),
              encode_frame(DATA, "t-0", 2, stamped(batch(1, 2), 2))]
    data = b"".join(frames)
    decoded, end = decode_frames(data)
    assert end == len(data)
    assert [(f.kind, f.name, f.offset) for f in decoded] == [
        (DATA, "t-0", 0), (CUT, "t-1", 7), (BASE, "__txn_log-3", 12), (DATA, "t-0", 2)]
    assert bytes(decoded[0].payload) == stamped(batch(1, 0), 0)
    first_three = sum(len(f) for f in frames[:3])
    for cut in range(first_three, len(data)):  # torn anywhere in the last frame
        assert decode_frames(data[:cut]) [1] == first_three
    damaged = bytearray(data)
    damaged[len(frames[0]) + 10] ^= 0x40  # inside the second frame
    assert decode_frames(bytes(damaged)) == (decoded[:1], len(frames[0]))
    with pytest.raises(ValueError):
        encode_frame(DATA, "", 0)


def frame_list(*specs) -> list:
    frames, _ = decode_frames(b"".join(encode_frame(*spec) for spec in specs))
    return frames


def data_frame(name: str, base: int, *sequences: int):
    payload, offset = b"", base
    for sequence in sequences:
        payload += stamped(batch(1, sequence), offset)
        offset += 2
    return (DATA, name, base, payload)


def test_the_plan_applies_appends_cuts_and_bases_in_the_order_they_were_written():
    plans = plan(frame_list(data_frame("a", 10, 0, 2), data_frame("b", 0, 0),
                            data_frame("a", 14, 4), (CUT, "a", 12),
                            data_frame("a", 12, 9, 11), (CUT, "c", 5)))
    a = plans["a"]
    assert a.start == 10 and a.end == 16 and a.error is None
    assert [(base, last) for base, last, _ in a.batches] == [(10, 11), (12, 13), (14, 15)]
    assert parse_header(a.batches[1][2]).base_sequence == 9  # the batch after the cut
    assert plans["b"].start == 0 and plans["b"].end == 2
    assert plans["c"] == Plan(5, lowest_cut=5)  # a cut with nothing after: the log ends there
    assert a.lowest_cut == 12  # the replay rewrites from there at least
    # A cut below every frame lowers the start: the log is cut there on replay.
    assert plan(frame_list(data_frame("a", 10, 0), (CUT, "a", 4)))["a"] == Plan(4, lowest_cut=4)
    # A base voids everything before it (a re-created partition starts again).
    again = plan(frame_list(data_frame("a", 10, 0, 2), (BASE, "a", 0), data_frame("a", 0, 0)))
    assert again["a"].start == 0 and again["a"].end == 2
    # Frames that do not continue each other are an error, not a guess.
    broken = plan(frame_list(data_frame("a", 10, 0), data_frame("a", 20, 2)))["a"]
    assert broken.error is not None and "ended at 12" in broken.error
    assert plan(frame_list(data_frame("a", 10, 0), data_frame("a", 20, 2),
                           (BASE, "a", 30)))["a"] == Plan(30)
    mislabelled = plan(frame_list((DATA, "a", 3, stamped(batch(1, 0), 0))))["a"]
    assert mislabelled.error is not None


def test_the_ledger_lets_sealed_segments_go_once_every_partition_checkpointed_them():
    ledger = SegmentLedger()
    ledger.open(0)
    ledger.wrote("a", 10)
    ledger.wrote("b", 4)
    ledger.open(1)
    ledger.wrote("a", 20)
    ledger.open(2)
    checkpoints = {"a": 9, "b": 4}
    assert ledger.removable(lambda name: checkpoints.get(name, -1)) == []
    checkpoints["a"] = 15
    assert ledger.removable(lambda name: checkpoints.get(name, -1)) == [0]
    # A cut lowers what older frames wait for; a base voids them.
    ledger.cut("a", 15)
    assert ledger.removable(lambda name: checkpoints.get(name, -1)) == [1]
    ledger.wrote("c", 3)
    ledger.open(3)
    ledger.base("c")
    assert ledger.removable(lambda name: -1) == [2]
    assert ledger.removable(lambda name: 1 << 40) == []  # the newest one stays


# ---------------------------------------------------------------------------- owners
class AtTheFloor:
    """A power cut's "random" that loses everything it may lose."""

    @staticmethod
    def randint(low: int, _high: int) -> int:
        return low


class Submitting:
    """Stands in for the write-ahead file's LogSync: `submit` is the test's."""

    def __init__(self, submit):
        self.submit = submit


class RefusingRounds:
    """Stands in for the write-ahead file's LogSync: the next `failing` rounds' fsyncs
    fail (EIO, "injected"), the others are the real ones."""

    def __init__(self, wal: WriteAheadLog):
        self.real, self.failing = wal._sync.submit, 1

    def submit(self, fd, wake):
        if not self.failing:
            return self.real(fd, wake)
        self.failing -= 1
        ticket = durability.SyncTicket(wake)
        asyncio.get_running_loop().call_soon(
            lambda: (ticket.finish(OSError(5, "injected")), wake()))
        return ticket


SETTINGS = OwnerSettings(log=LogConfig(segment_bytes=16 << 10), durability=durability.WAL)

# A crashed Node's write-ahead file must not touch the disk any more, as a dead process
# would not. Its checkpointer's trim deletes segments on a worker thread, which the
# cancelled task leaves running: a deletion landing while the next Node's recovery read
# the segments failed it (FileNotFoundError, seen in CI). So the trims go through this
# lock, and `Node.crash` marks its file's directory (the Path object its trims were
# given) dead under it: a deletion under way ends first, later ones do nothing.
_UNLINKS = threading.Lock()
_DEAD_DIRECTORIES: list[Path] = []


@pytest.fixture(autouse=True)
def _dead_files_stay_dead(monkeypatch):
    retire = wal_module._retire_segments

    def unless_dead(directory: Path, *args) -> None:
        with _UNLINKS:  # (the listing of checkpoints too: a stale one would cut)
            if not any(directory is dead for dead in _DEAD_DIRECTORIES):
                retire(directory, *args)

    monkeypatch.setattr(wal_module, "_retire_segments", unless_dead)
    yield
    _DEAD_DIRECTORIES.clear()


class Node:
    """Partition owners and their write-ahead file in this process, crashed and restarted
    as a server process would be (without its gRPC shell)."""

    def __init__(self, root: Path, partitions: int, *, checkpoint_ms: int = 50,
                 segment_bytes: int = 1 << 20, settings: OwnerSettings | None = None):
        self.root, self.partitions = root, partitions
        self.settings = settings or SETTINGS
        self.checkpoint_ms, self.segment_bytes = checkpoint_ms, segment_bytes
        self.wal: WriteAheadLog | None = None
        self.owners: list[PartitionOwner] = []

    async def start(self) -> dict:
        self.wal = WriteAheadLog(self.root / "wal", checkpoint_ms=self.checkpoint_ms,
                                 segment_bytes=self.segment_bytes)
        replayed = await asyncio.to_thread(self.wal.recover_all, self.root / "p",
                                           self.settings.log)
        await self.wal.start()
        self.owners = [PartitionOwner("t", i, self.root / "p" / f"t-{i}", self.settings,
                                      wal=self.wal) for i in range(self.partitions)]
        for owner in self.owners:
            await owner.start()
        return replayed

    async def crash(self, rng: random.Random, durable_wal: dict[int, int]) -> None:
        """A power cut: nothing is closed or synced; every file loses some of what was not
        made durable."""
        wal = self.wal
        wal._checkpointer.cancel()
        for owner in self.owners:
            owner._task.cancel()
            if owner._roll is not None:  # its thread holds a duplicate of the log's lock
                await asyncio.wait([owner._roll.future])
            durable = owner.log.durable_offset
            owner.log.fail("power cut")
            owner.log.close()
            cut_back(owner.directory, durable, rng)
        os.close(wal._fd)
        wal._fd = -1
        # Nothing the dead process would still do reaches the disk: a round already
        # scheduled (or one a late callback asks for) would otherwise roll a segment
        # the cut below left short and write frames after the cut ones.
        if wal._turn is not None:
            wal._turn.cancel()
            wal._turn = None
        if wal._preparer is not None:  # a next segment's zeros: done before the cut
            wal._preparer.shutdown(wait=True)
        with _UNLINKS:  # its trims' deletions: ended, and none from now on
            _DEAD_DIRECTORIES.append(wal.directory)
            directory, wal.directory = wal.directory, wal.directory / "after-the-power-cut"
        sequences = list_segments(directory)
        for sequence in sequences[-1:]:  # a roll fsyncs the segment it seals
            path = directory / f"{sequence:020d}.wal"
            size = wal._sizes.get(sequence, 0)  # written; zeros after it (preallocated)
            keep = durable_wal.get(sequence, 0)
            os.truncate(path, rng.randint(min(keep, size), size))
        await asyncio.sleep(0)

    async def close(self) -> None:
        for owner in self.owners:
            await owner.close()
        await self.wal.close()


def cut_back(directory: Path, durable: int, rng: random.Random) -> None:
    """Cut the partition's last segment file back to a random position at or above the
    end of offset `durable`'s batches (sealed segments were fsynced by their roll)."""
    segments = sorted(directory.glob("*.log"))
    last = segments[-1]
    data = last.read_bytes()
    floor = 0
    for position, header in iter_batches(data):
        if header.base_offset < durable:
            floor = position + header.size
    os.truncate(last, rng.randint(floor, len(data)))


def wal_sizes(wal: WriteAheadLog) -> dict[int, int]:
    """What each segment holds: the bytes written to it (its file is preallocated)."""
    return {s: wal._sizes.get(s, 0) for s in list_segments(wal.directory)}


def read_all(owner: PartitionOwner) -> list[tuple[int, bytes]]:
    """(base offset, the batch's bytes after the prefix the log stamps) of every batch in
    the log."""
    return [(header.base_offset, data[21:]) for header, data in read_headers(owner)]


def read_headers(owner: PartitionOwner) -> list[tuple]:
    data = b"".join(p.read_bytes() for p in sorted(owner.directory.glob("*.log")))
    return [(header, data[position:position + header.size])
            for position, header in iter_batches(data)]


@pytest.mark.parametrize("seed", range(1, 7))
def test_acknowledged_batches_survive_random_power_cuts_exactly_once(tmp_path, seed):
    rng = random.Random(seed)
    sent: dict[tuple[int, int], bytes] = {}  # (partition, sequence) -> batch
    acked: dict[tuple[int, int], int] = {}  # (partition, sequence) -> base offset
    next_sequence = [0, 0, 0]

    async def scenario():
        node = Node(tmp_path, 3, checkpoint_ms=rng.choice([20, 1_000]),
                    segment_bytes=rng.choice([1 << 20, 8 << 10]))
        await node.start()
        replayed = 0
        for cycle in range(4):
            for _ in range(rng.randint(5, 40)):
                produced = []
                for partition in rng.sample(range(3), rng.randint(1, 3)):
                    sequence = next_sequence[partition]
                    next_sequence[partition] += 2
                    b = batch(7, sequence, os.urandom(rng.randint(10, 400)))
                    sent[(partition, sequence)] = b
                    produced.append(((partition, sequence), node.owners[partition].produce(
                        [(b, parse_header(b))])))
                for key, pending in produced:
                    result = (await pending)[0]
                    assert not isinstance(result, AtomlogError), result
                    acked[key] = result.base_offset
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.choice([0.01, 0.06]))  # checkpoints may run
                if rng.random() < 0.3:
                    await node.wal._trim()  # only what a checkpoint covered may go
            durable_wal = wal_sizes(node.wal)  # every round so far was answered
            # in flight at the crash: written maybe, never acknowledged (over a few
            # event-loop turns, so rounds may overlap, and roll small segments)
            for _ in range(rng.randint(1, 3)):
                for partition in range(3):
                    sequence = next_sequence[partition]
                    next_sequence[partition] += 2
                    b = batch(7, sequence, os.urandom(rng.randint(10, 2_000)))
                    sent[(partition, sequence)] = b
                    asyncio.ensure_future(node.owners[partition].produce([(b, parse_header(b))]))
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            await node.crash(rng, durable_wal)
            node = Node(tmp_path, 3, checkpoint_ms=node.checkpoint_ms,
                        segment_bytes=node.segment_bytes)
            replayed += sum((await node.start()).values())
            for partition, owner in enumerate(node.owners):
                assert owner.state is State.ONLINE, (owner.state, owner.log and owner.log.data_loss)
                batches = read_all(owner)
                by_offset = dict(batches)
                assert len(by_offset) == len(batches)
                for (p, sequence), offset in acked.items():
                    if p == partition:
                        assert by_offset.get(offset) == sent[(p, sequence)][21:], (
                            cycle, partition, sequence, offset)
                found = [header.base_sequence for header, _ in read_headers(owner)]
                assert len(found) == len(set(found)), "a batch is in the log twice"
                assert all((partition, s) in sent for s in found)
                # the sequences a producer retries from: what the log holds
                next_sequence[partition] = max(found, default=-2) + 2
                for key in [k for k in sent if k[0] == partition and k[1] >= next_sequence[
                        partition]]:
                    del sent[key]
        await node.close()
        assert list_segments(tmp_path / "wal") == []  # a clean close leaves nothing
        assert replayed > 0  # the power cuts lost data the frames brought back

    asyncio.run(scenario())


def test_group_commits_share_one_write_ahead_fsync_and_checkpoints_trim_the_file(tmp_path):
    async def scenario():
        node = Node(tmp_path, 4, checkpoint_ms=60_000, segment_bytes=1 << 20)
        await node.start()
        wal = node.wal
        wal.segment_bytes = 4 << 10  # small segments, so that some can go
        before = durability.barrier().syncs
        for sequence in range(0, 80, 2):
            results = await asyncio.gather(*[
                o.produce([(batch(1, sequence), parse_header(batch(1, sequence)))])
                for o in node.owners])
            assert all(not isinstance(r[0], AtomlogError) for r in results)
        # one fsync a round for all four owners, and none of their files' own
        assert durability.barrier().syncs - before == 40
        assert all(o.log.durable_offset == 0 for o in node.owners)
        assert all(o.log.high_watermark == 80 for o in node.owners)
        assert len(list_segments(wal.directory)) > 3
        assert wal.checkpoint() == 4
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all(o.log.durable_offset == 80 for o in node.owners):
                break
        assert all(o.log.durable_offset == 80 for o in node.owners)
        assert wal.checkpoint() == 0  # nothing new since
        await wal._trim()
        assert len(list_segments(wal.directory)) == 1  # only the active one stays
        await node.close()

    asyncio.run(scenario())


def test_a_checkpoint_begins_early_once_enough_bytes_were_framed_since_the_last(tmp_path):
    """The interval is a minute: only `checkpoint_bytes` can begin a checkpoint here.
    Below it nothing becomes durable in the partitions' files; past it they all do, and
    the count starts again."""
    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        wal = node.wal

        async def produce(sequence: int) -> None:
            data = batch(1, sequence)  # small: no segment of the partitions' rolls
            results = await asyncio.gather(*[o.produce([(data, parse_header(data))])
                                             for o in node.owners])
            assert all(not isinstance(r[0], AtomlogError) for r in results)

        wal.checkpoint_bytes = 64 << 10
        sequence = 0
        while wal._since_checkpoint + (16 << 10) < wal.checkpoint_bytes:  # below it
            await produce(sequence)  # a round: both batches' frames and the padding
            sequence += 2
        await asyncio.sleep(0.2)
        assert sequence >= 8
        assert all(o.log.durable_offset == 0 for o in node.owners)
        below = sequence
        for _ in range(8):  # a round or two more pass it: the checkpointer wakes at once
            await produce(sequence)
            sequence += 2
        for _ in range(200):
            await asyncio.sleep(0.01)
            if all(o.log.durable_offset >= below for o in node.owners):
                break
        assert all(o.log.durable_offset >= below for o in node.owners)
        assert wal._since_checkpoint < wal.checkpoint_bytes  # counted again from there
        await node.close()

    asyncio.run(scenario())


def test_every_write_starts_on_a_fresh_page_and_the_padding_is_skipped(tmp_path, monkeypatch):
    """A round's fsync writes its last page back and the kernel holds that page's lock
    meanwhile: a next round writing into the same page waited for it in the event loop's
    thread (40-470 ms at a time on this machine, 2026-12-02). Every write ends with a PAD
    frame on a page boundary, so each starts on a page no earlier write touched; the
    replay reads through the padding to the frames."""
    from partition_server import wal as wal_module

    starts: list[int] = []
    real_writev = wal_module._writev_all

    def writev(fd, buffers):
        starts.append(os.lseek(fd, 0, os.SEEK_CUR))
        real_writev(fd, buffers)

    monkeypatch.setattr(wal_module, "_writev_all", writev)
    written: list[tuple[int, int]] = []

    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000, segment_bytes=64 << 10)
        await node.start()
        for turn in range(12):
            b = batch(1, 2 * turn, os.urandom(100 + 300 * turn))
            result = (await node.owners[0].produce([(b, parse_header(b))]))[0]
            assert not isinstance(result, AtomlogError), result
            written.append((result.base_offset, len(b)))
        segments = [((node.wal.directory / f"{s:020d}.wal").read_bytes(), node.wal._sizes[s])
                    for s in list_segments(node.wal.directory)]
        await node.close()
        return segments

    segments = asyncio.run(scenario())
    assert len(starts) > 12 and all(start % PAGE_BYTES == 0 for start in starts), starts
    frames = []
    for data, filled in segments:
        assert len(data) >= 64 << 10 and filled % PAGE_BYTES == 0  # preallocated
        assert data[filled:] == bytes(len(data) - filled)  # a write may pass the end
        found, end = decode_frames(data)
        assert end == filled  # the padding is part of the valid prefix, the zeros not
        frames += found
    assert [f.offset for f in frames if f.kind == DATA and f.name == "t-0"] == \
        [offset for offset, _ in written]
    assert {f.kind for f in frames} <= {DATA, BASE}


def test_padding_reaches_the_next_page_boundary_or_the_one_after_when_the_gap_is_short():
    assert padding(0) == padding(PAGE_BYTES) == []
    for size in (1, 100, PAGE_BYTES - 19, PAGE_BYTES - 18, PAGE_BYTES - 1, 3 * PAGE_BYTES + 7):
        pad = b"".join(padding(size))
        assert (size + len(pad)) % PAGE_BYTES == 0 and 19 <= len(pad) < PAGE_BYTES + 19
        frames, end = decode_frames(encode_frame(DATA, "p", 0, b"") + pad)
        assert end == 19 + len(pad) and [f.kind for f in frames] == [DATA]
    # a damaged pad ends the valid prefix like any other frame
    pad = bytearray(b"".join(padding(100)))
    pad[-1] ^= 1
    assert decode_frames(bytes(pad)) == ([], 0)


def test_a_roll_makes_the_old_segment_durable_before_the_new_one_takes_a_frame(
        tmp_path, monkeypatch):
    """Rounds overlap: the last round on a segment may still be fsyncing when the next
    round rolls to a new one. Unless the old segment is durable first, a power cut could
    keep the new segment's frames of a partition and lose the old one's tail they
    continue: the replay's plan then refuses the partition as DATA_LOSS, although
    nothing acknowledged was lost (rounds are answered in order, so none after the torn
    one was). So the roll fsyncs the old segment, as it is when the roll begins, before
    the new one is written."""
    from partition_server import wal as wal_module

    events: list[tuple] = []
    real_writev = wal_module._writev_all

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def writev(fd, buffers):
        events.append(("write", path_of(fd)))
        real_writev(fd, buffers)

    def fsync(fd):
        events.append(("fsync", path_of(fd), os.fstat(fd).st_size))
        os.fsync(fd)

    async def scenario():
        node = Node(tmp_path, 3, checkpoint_ms=60_000, segment_bytes=16 << 10)  # 4 rounds (pages)
        await node.start()
        node.wal._fsync = fsync
        monkeypatch.setattr(wal_module, "_writev_all", writev)
        sequences = [0] * len(node.owners)
        for turn in range(30):
            produced = []
            for index, owner in enumerate(node.owners[:1 + turn % 3]):
                b = batch(1, sequences[index])
                sequences[index] += 2
                produced.append(owner.produce([(b, parse_header(b))]))
            results = await asyncio.gather(*produced)
            assert all(not isinstance(r[0], AtomlogError) for r in results), results
        monkeypatch.setattr(wal_module, "_writev_all", real_writev)
        segments = [str(node.wal.directory / f"{s:020d}.wal")
                    for s in list_segments(node.wal.directory)]
        sizes = {path: os.stat(path).st_size for path in segments}
        await node.close()
        return segments, sizes

    segments, sizes = asyncio.run(scenario())
    assert len(segments) > 4, segments
    for old, new in zip(segments, segments[1:]):
        first_write = events.index(("write", os.path.realpath(new)))
        assert ("fsync", os.path.realpath(old), sizes[old]) in events[:first_write], (
            old, events[:first_write][-5:])


def test_a_cut_is_framed_before_it_is_made_and_replays_in_order(tmp_path):
    """A failed round fails the owner closed; its reload cuts back to the high watermark
    with a CUT frame first; the frames of the cut batches, earlier in the file, are void
    on replay, so the batches written after the cut at the same offsets come back."""
    async def scenario():
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()
        owner = node.owners[0]
        first = batch(1, 0)
        assert (await owner.produce([(first, parse_header(first))]))[0].base_offset == 0
        refusing = node.wal._sync = RefusingRounds(node.wal)
        lost = batch(1, 2, b"lost" * 10)
        with pytest.raises(AtomlogError, match="PARTITION_LOADING|injected"):
            await owner.produce([(lost, parse_header(lost))])
        for _ in range(200):
            await asyncio.sleep(0.01)
            if owner.state is State.ONLINE and owner.log.log_end_offset == 2:
                break
        assert owner.state is State.ONLINE and owner.log.log_end_offset == 2
        again = batch(1, 2, b"kept" * 10)
        assert (await owner.produce([(again, parse_header(again))]))[0].base_offset == 2
        frames = [f for s in list_segments(node.wal.directory) for f in decode_frames(
            (node.wal.directory / f"{s:020d}.wal").read_bytes())[0]]
        kinds = [(f.kind, f.offset) for f in frames if f.name == "t-0"]
        assert (CUT, 2) in kinds
        assert kinds.index((CUT, 2)) < kinds.index((DATA, 2), kinds.index((CUT, 2)))
        await node.crash(AtTheFloor(), wal_sizes(node.wal))  # all that was not fsynced lost
        node = Node(tmp_path, 1)
        await node.start()
        assert [body for _, body in read_all(node.owners[0])] == [first[21:], again[21:]]
        await node.close()

    asyncio.run(scenario())


def test_a_failed_checkpoint_reloads_the_partition_and_rewrites_it_from_the_frames(tmp_path):
    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        for sequence in range(0, 20, 2):
            for owner in node.owners:
                b = batch(1, sequence)
                assert (await owner.produce([(b, parse_header(b))]))[0].base_offset == sequence
        wal = node.wal
        real_sync = wal._sync
        real_submit = real_sync.submit
        victim = node.owners[0]

        def fail_the_victim_s_file(fd, wake):
            if os.path.samestat(os.fstat(fd), os.fstat(victim.log._active.fd)):
                ticket = durability.SyncTicket(wake)
                asyncio.get_running_loop().call_soon(
                    lambda: (ticket.finish(OSError(5, "injected")), wake()))
                return ticket
            return real_submit(fd, wake)

        wal._sync = Submitting(fail_the_victim_s_file)
        old_log = victim.log
        assert wal.checkpoint() == 2
        for _ in range(300):
            await asyncio.sleep(0.01)
            if victim.log is not old_log and victim.state is State.ONLINE:
                break
        wal._sync = real_sync
        assert victim.log is not old_log and victim.state is State.ONLINE
        assert victim.replayed_from_wal == 10  # rewritten from the frames, not trusted
        assert victim.log.durable_offset == 20 == victim.log.high_watermark
        assert node.owners[1].log.durable_offset == 20  # its checkpoint went through
        await node.close()

    asyncio.run(scenario())


def test_a_log_that_ends_below_its_frames_enters_data_loss(tmp_path):
    """Frames start where the last checkpoint left the log: a log found shorter than that
    lost data that was durable, which fails the partition closed (DATA_LOSS)."""
    async def scenario():
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()
        owner = node.owners[0]
        await produce_run(owner, 0, 6)
        assert node.wal.checkpoint() == 1
        for _ in range(100):
            await asyncio.sleep(0.01)
            if owner.log.durable_offset == 6:
                break
        b = batch(1, 6)
        await owner.produce([(b, parse_header(b))])
        durable_wal = wal_sizes(node.wal)
        await node.crash(random.Random(1), durable_wal)
        for path in (tmp_path / "p" / "t-0").glob("*.log"):
            os.truncate(path, 0)  # the checkpointed batches gone too: a lying disk
        node = Node(tmp_path, 1)
        await node.start()
        assert node.owners[0].state is State.DATA_LOSS
        await node.close()

    asyncio.run(scenario())


async def fill_until_refused(owner: PartitionOwner, sequence: int) -> int:
    """Producer 1's batches of 300 bytes from `sequence` until the write-ahead file is
    full (RESOURCE_EXHAUSTED); the next sequence."""
    with pytest.raises(AtomlogError) as refused:
        for _ in range(100):
            b = batch(1, sequence, b"x" * 300)
            await owner.produce([(b, parse_header(b))])
            sequence += 2
    assert refused.value.reason == "RESOURCE_EXHAUSTED"
    return sequence


async def checkpointed_and_trimmed(wal: WriteAheadLog, owner: PartitionOwner) -> None:
    """A checkpoint of the owner's file (waited for), then a trim."""
    end = owner.log.log_end_offset
    assert wal.checkpoint() == 1
    for _ in range(100):
        await asyncio.sleep(0.01)
        if owner.log.durable_offset == end:
            break
    await wal._trim()


def test_past_its_byte_limit_the_file_refuses_new_writes_until_checkpoints_free_it(tmp_path):
    """partition.wal_max_bytes: a group is refused whole (RESOURCE_EXHAUSTED, nothing
    written) while the kept segments reach the limit; a checkpoint and the trim after it
    let writes in again."""
    async def scenario():
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()
        wal, owner = node.wal, node.owners[0]
        wal.segment_bytes, wal.max_bytes = 2 << 10, 6 << 10
        sequence = await fill_until_refused(owner, 0)
        end = owner.log.log_end_offset
        assert end == owner.log.high_watermark == sequence  # the refused group wrote nothing
        await checkpointed_and_trimmed(wal, owner)
        assert wal.full() is None
        b = batch(1, sequence, b"x" * 300)
        assert (await owner.produce([(b, parse_header(b))]))[0].base_offset == end
        await node.close()

    asyncio.run(scenario())


def test_a_checkpoint_that_cannot_begin_for_one_file_is_tried_again_and_skips_no_other(
        tmp_path):
    """The fsync of a checkpoint could not be submitted for one partition's file (os.dup at
    the descriptor limit, say). Before, that partition stayed marked as in a checkpoint
    for ever: it was never checkpointed again, so its frames held the write-ahead file
    until it filled and refused every partition's writes; and the round stopped there,
    so the files after it waited for the next interval. Now the others begin in the same
    round and the next checkpoint takes the one that failed."""
    async def scenario():
        node = Node(tmp_path, 3, checkpoint_ms=60_000)
        await node.start()
        wal = node.wal
        for sequence in range(0, 6, 2):
            data = batch(1, sequence)
            await asyncio.gather(*[o.produce([(data, parse_header(data))])
                                   for o in node.owners])
        first = node.owners[0].log
        refused = []

        class FailingOnce:  # the file's LogSync, failing the first submit for `first`
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def submit(self, fd, wake=None):
                if fd == first._active.fd and not refused:
                    refused.append(fd)
                    raise OSError(24, "Too many open files (test)")
                return self.inner.submit(fd, wake)

        wal._sync = FailingOnce(wal._sync)
        assert wal.checkpoint() == 2 and refused  # the two others began
        for _ in range(200):
            await asyncio.sleep(0.01)
            if all(o.log.durable_offset == 6 for o in node.owners[1:]):
                break
        assert [o.log.durable_offset for o in node.owners] == [0, 6, 6]
        assert wal.checkpoint() == 1  # the one that failed, tried again
        for _ in range(200):
            await asyncio.sleep(0.01)
            if first.durable_offset == 6:
                break
        assert first.durable_offset == 6
        await node.close()

    asyncio.run(scenario())


def test_one_partition_s_frames_are_read_alone():
    frames = frame_list(data_frame("a", 0, 0), (CUT, "b", 3), data_frame("a", 2, 2))
    data = b"".join(encode_frame(f.kind, f.name, f.offset, bytes(f.payload)) for f in frames)
    only, end = decode_frames(data, b"a")
    assert [(f.name, f.offset) for f in only] == [("a", 0), ("a", 2)] and end == len(data)
    damaged = bytearray(data)
    damaged[-5] ^= 1  # in the last frame, one of a's: the prefix ends before it
    assert [f.offset for f in decode_frames(bytes(damaged), b"a")[0]] == [0]


def test_frames_a_failed_write_dropped_fail_their_partition_s_later_flush(tmp_path, monkeypatch):
    """A round's write fails with frames of a partition that has not asked for a round
    yet: its flush in the next round (which succeeds) must fail too, and its owner is
    told to reload; its BASE frame (the reload's) ends that."""
    import partition_server.wal as wal_module

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        told: list[str] = []
        for name in ("a", "b"):
            wal.tap(name).on_failure = lambda error, name=name: told.append(name)
        real = wal_module._writev_all
        failing = [True]

        def fail_once(fd, buffers):
            if failing:
                failing.clear()
                raise OSError(28, "No space left on device")
            real(fd, buffers)

        monkeypatch.setattr(wal_module, "_writev_all", fail_once)
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)  # a wrote, has not asked yet
        wal.queue(b"b", "b", 0, stamped(batch(1, 0), 0), 2)
        done = asyncio.get_running_loop().create_future()
        first = wal.sync("b", lambda: done.set_result(None))
        await done
        assert isinstance(first.exception(), OSError)
        done = asyncio.get_running_loop().create_future()
        later = wal.sync("a", lambda: done.set_result(None))
        await done
        assert isinstance(later.exception(), OSError)  # its frames went with b's round
        await asyncio.sleep(0)
        assert sorted(told) == ["a", "b"]
        await asyncio.to_thread(wal.write_base, "a", 0)  # a reloaded
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)
        done = asyncio.get_running_loop().create_future()
        again = wal.sync("a", lambda: done.set_result(None))
        await done
        assert again.exception() is None
        await wal.close()

    asyncio.run(scenario())


async def synced(wal: WriteAheadLog, name: str) -> BaseException | None:
    """Ask a round for partition `name` and wait for its answer: its error, or None."""
    done = asyncio.get_running_loop().create_future()
    ticket = wal.sync(name, lambda: done.set_result(None))
    await done
    return ticket.exception()


def test_frames_of_a_lost_partition_are_not_written_until_its_reload(tmp_path, monkeypatch):
    """A failed write dropped partition a's frames at [2, 4); a, busy, wrote [4, 6) before
    it learned of the loss, and those frames went into the next segment. The reload's
    plan then found a frame at 4 that did not continue the one ending at 2: DATA_LOSS,
    though nothing acknowledged was lost (and after a power cut, acknowledged frames
    were never replayed). Now a lost partition's frames are not written until its BASE
    frame: its plan ends at 2, and the reload cuts the unacknowledged rest."""
    import partition_server.wal as wal_module
    from partition_server.wal import read_frames

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        real = wal_module._writev_all
        failing = [False]

        def fail_once(fd, buffers):
            if failing:
                if failing.pop():
                    raise OSError(5, "Input/output error")
            real(fd, buffers)

        monkeypatch.setattr(wal_module, "_writev_all", fail_once)
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)
        assert await synced(wal, "a") is None
        failing[:] = [True]
        wal.queue(b"a", "a", 2, stamped(batch(1, 2), 2), 4)
        assert isinstance(await synced(wal, "b"), OSError)
        wal.queue(b"a", "a", 4, stamped(batch(1, 4), 4), 6)  # before a heard of it
        wal.queue(b"b", "b", 0, stamped(batch(1, 0), 0), 2)
        assert await synced(wal, "b") is None
        assert isinstance(await synced(wal, "a"), OSError)  # (lost until its reload)
        plans = plan(read_frames(wal.directory))
        assert plans["a"].error is None and plans["a"].end == 2, plans["a"]
        assert plans["b"].error is None and plans["b"].end == 2
        await asyncio.to_thread(wal.write_base, "a", 2)  # a reloaded, its log at 2
        wal.queue(b"a", "a", 2, stamped(batch(1, 2), 2), 4)
        assert await synced(wal, "a") is None
        plans = plan(read_frames(wal.directory))
        assert plans["a"].error is None and (plans["a"].start, plans["a"].end) == (2, 4)
        await wal.close()

    asyncio.run(scenario())


def test_segments_of_a_partition_that_could_not_be_replayed_are_kept_aside(tmp_path):
    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        for owner in node.owners:
            b = batch(1, 0)
            await owner.produce([(b, parse_header(b))])
        await node.crash(AtTheFloor(), wal_sizes(node.wal))
        (tmp_path / "p" / "t-1" / "data-loss.json").write_text(
            '{"file": "00000000000000000000.log", "position": 0, "offset": 0, '
            '"detail": "test", "detected_unix_ms": 1}')
        node = Node(tmp_path, 2)
        assert (await node.start()) == {"t-0": 1, "t-1": 0}
        kept = list((tmp_path / "wal").glob("kept-*/*.wal"))
        assert len(kept) == 1 and kept[0].stat().st_size > 0
        assert node.owners[0].state is State.ONLINE and node.owners[0].log.high_watermark == 2
        assert node.owners[1].state is State.DATA_LOSS
        await node.close()

    asyncio.run(scenario())


def test_a_start_in_another_mode_replays_what_a_wal_mode_start_left(tmp_path):
    """partition.durability changed from wal to fsync across a crash: the frames still
    go into the partitions before anything opens (server.py calls replay_leftover)."""
    from partition_server.wal import replay_leftover

    async def scenario():
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()
        b = batch(1, 0)
        await node.owners[0].produce([(b, parse_header(b))])
        await node.crash(AtTheFloor(), wal_sizes(node.wal))

    asyncio.run(scenario())
    assert replay_leftover(tmp_path / "wal", tmp_path / "p", SETTINGS.log) == {"t-0": 1}
    assert list_segments(tmp_path / "wal") == []
    assert replay_leftover(tmp_path / "wal", tmp_path / "p", SETTINGS.log) is None

    async def reopened():
        owner = PartitionOwner("t", 0, tmp_path / "p" / "t-0",
                               OwnerSettings(log=LogConfig(), durability=durability.FSYNC))
        await owner.start()
        assert owner.log.high_watermark == 2
        await owner.close()

    asyncio.run(reopened())


def test_a_round_asked_for_before_close_fails_and_nothing_is_written_after_it(tmp_path):
    """A round is run on the next event-loop turn after it is asked for; one asked for
    just before close() used to run while close was under way or after it (then a write
    to a closed descriptor, or a roll to a new segment the close left behind). Once
    close() begins, rounds not begun fail, as does one asked for after close."""
    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)
        woken: list[str] = []
        before = wal.sync("a", lambda: woken.append("before"))
        await wal.close()
        after = wal.sync("a", lambda: woken.append("after"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert before.done() and isinstance(before.exception(), OSError)
        assert after.done() and isinstance(after.exception(), OSError)
        assert woken == ["before", "after"]
        # the queued frame written by close (unacknowledged), no segment rolled after it
        assert sorted(p.name for p in (tmp_path / "wal").iterdir()) == [
            "00000000000000000000.wal"]

    asyncio.run(scenario())


def test_a_burst_of_failed_rounds_does_not_fill_the_disk_with_preallocated_segments(
        tmp_path, monkeypatch):
    """A failed round poisons its segment and the next round rolls to a new one. Those
    rolls take empty files: a preallocated segment each filled chaos seed 2809's small
    disk within seconds of an fsync fault (every round failed), and nothing could trim
    them while the partitions reloaded. At most the active segment and the one made
    ahead are preallocated."""
    import partition_server.wal as wal_module

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000, segment_bytes=1 << 20)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        real = wal_module._writev_all
        failures = [0]

        def failing(fd, buffers):
            if failures[0] < 6:
                failures[0] += 1
                raise OSError(5, "injected")
            real(fd, buffers)

        monkeypatch.setattr(wal_module, "_writev_all", failing)
        for round_ in range(8):
            # (A partition of its own each round: a lost one's frames wait for its reload.)
            name = f"p{round_}"
            wal.queue(name.encode(), name, 0, stamped(batch(1, 0), 0), 2)
            done = asyncio.get_running_loop().create_future()
            wal.sync(name, lambda: done.set_result(None))
            await done
        # the preallocations asked for so far done (one worker, in order)
        await asyncio.to_thread(lambda: wal._preparer.submit(lambda: None).result())
        on_disk = sum(p.stat().st_size for p in (tmp_path / "wal").iterdir())
        segments = len(list_segments(tmp_path / "wal"))
        await wal.close()
        return on_disk, segments

    on_disk, segments = asyncio.run(scenario())
    assert segments >= 6  # a roll after each failed round
    assert on_disk < 2 * (1 << 20) + (64 << 10), on_disk


def test_a_segment_is_not_preallocated_where_the_disk_has_little_room(tmp_path, monkeypatch):
    """Preallocation must not be what fills a disk: with less than four segments' room
    free it is refused (the roll then appends to an empty file), and a fill that fails
    part way leaves no file behind."""
    import partition_server.wal as wal_module

    class Tight:
        f_bavail, f_frsize = 3, 1 << 20  # 3 MiB free

    monkeypatch.setattr(wal_module.os, "statvfs", lambda _path: Tight)
    with pytest.raises(OSError, match="free"):
        wal_module.preallocate(tmp_path / "prepared.wal.next", 1 << 20)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    def full(path, size):
        path.write_bytes(bytes(4096))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wal_module, "_zero_fill", full)
    with pytest.raises(OSError):
        wal_module.preallocate(tmp_path / "prepared.wal.next", 1 << 20)
    assert list(tmp_path.iterdir()) == []


class Keeping:
    """A power cut's "random" that keeps `size` bytes of a partition's file (never less
    than may be lost: the write-ahead file keeps what its rounds made durable)."""

    def __init__(self, size: int):
        self.size = size

    def randint(self, low: int, high: int) -> int:
        return min(high, max(low, self.size))


def _lose_a_directory_then_put_it_back(tmp_path: Path, written: int,
                                       kept_batches: int = 0) -> list[tuple[int, bytes]]:
    """Partition t-1's last `written` batches were acknowledged (durable in the write-
    ahead file) and not checkpointed; a power cut left its files with only the first
    `kept_batches` of them; a start
    found its directory missing (moved aside) and kept the file's segments aside; the
    directory came back before the next start. Returns t-1's batches before the cut."""
    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        for owner, count in zip(node.owners, (1, written), strict=True):
            for sequence in range(0, 2 * count, 2):
                b = batch(1, sequence)
                await owner.produce([(b, parse_header(b))])
        before = read_all(node.owners[1])
        size = sum(len(data) for _, data in read_headers(node.owners[1])[:kept_batches])
        await node.crash(Keeping(size), wal_sizes(node.wal))
        assert read_all(node.owners[1]) == before[:kept_batches]  # the rest lost: not synced
        (tmp_path / "p" / "t-1").rename(tmp_path / "aside")
        node = Node(tmp_path, 1)  # (as the server would: t-1 is not opened empty)
        await node.start()
        b = batch(2, 0)
        await node.owners[0].produce([(b, parse_header(b))])
        await node.close()
        (tmp_path / "aside").rename(tmp_path / "p" / "t-1")
        return before

    return asyncio.run(scenario())


@pytest.mark.parametrize("kept_batches", [0, 1, 3])
def test_frames_kept_aside_for_a_missing_directory_are_replayed_when_it_comes_back(
        tmp_path, kept_batches):
    """What a lost directory held only in the page cache, acknowledged through the write-
    ahead file, comes back with it: all of it lost, a part, or none (found by the chaos
    harness: seed 2932, `ctp`, the combined server: a `misplace` of its directories, a
    power cut right after they were put back, and 159 acknowledged writes gone, their
    offsets handed out again)."""
    before = _lose_a_directory_then_put_it_back(tmp_path, 3, kept_batches)
    [kept] = (tmp_path / "wal").glob("kept-*")
    assert (kept / "kept.json").read_text() == '{"missing": ["t-1"], "data_loss": []}'

    async def reopened():
        node = Node(tmp_path, 2)
        await node.start()
        assert node.owners[1].state is State.ONLINE
        assert node.owners[1].log.high_watermark == 6 and read_all(node.owners[1]) == before
        assert node.owners[0].log.high_watermark == 4
        assert not list((tmp_path / "wal").glob("kept-*"))  # nothing left to keep
        await node.close()

    asyncio.run(reopened())


def test_kept_frames_go_only_into_their_own_log_and_never_after_the_loss_was_accepted(tmp_path):
    """A directory back that holds other batches where the frames begin is another log:
    it is left as it is. And an operator's accepting the loss (RecoverPartition calls
    forget_kept) gives the frames up for good."""
    from partition_server.log import PartitionLog
    from partition_server.wal import forget_kept

    _lose_a_directory_then_put_it_back(tmp_path / "other", 2)
    directory = tmp_path / "other" / "p" / "t-1"
    shutil.rmtree(directory)
    directory.mkdir()
    other = PartitionLog(directory, SETTINGS.log)
    other.append([batch(7, 0)])
    other.flush()
    other.close()

    _lose_a_directory_then_put_it_back(tmp_path / "forgotten", 2)
    forget_kept(tmp_path / "forgotten" / "wal", "t-1")
    [kept] = (tmp_path / "forgotten" / "wal").glob("kept-*")
    assert (kept / "kept.json").read_text() == '{"missing": [], "data_loss": []}'

    async def reopened(root: Path) -> list:
        node = Node(root, 2)
        await node.start()
        headers = [header for header, _ in read_headers(node.owners[1])]
        await node.close()
        assert not list((root / "wal").glob("kept-*"))
        return headers

    [only] = asyncio.run(reopened(tmp_path / "other"))
    assert only.producer_id == 7 and only.base_offset == 0
    assert asyncio.run(reopened(tmp_path / "forgotten")) == []


def test_a_start_in_another_mode_replays_kept_frames_into_a_directory_back(tmp_path):
    """partition.durability changed from wal while frames were kept aside for a missing
    directory: they still go into it once it is back (server.py calls replay_leftover)."""
    from partition_server.log import PartitionLog
    from partition_server.wal import replay_leftover

    _lose_a_directory_then_put_it_back(tmp_path, 2)
    for path in (tmp_path / "wal").glob("*.wal"):  # the clean close checkpointed them
        path.unlink()
    assert replay_leftover(tmp_path / "wal", tmp_path / "p", SETTINGS.log) is None
    log = PartitionLog(tmp_path / "p" / "t-1", SETTINGS.log)
    assert log.log_end_offset == 4
    log.close()
    assert not list((tmp_path / "wal").glob("kept-*"))


def test_an_operator_sees_what_is_kept_aside_and_what_becomes_of_it(tmp_path):
    """`atomlog partition kept-frames` (wal.describe_kept): per kept directory and
    partition, the offsets its frames cover, their fate and the directory's state; read
    only. A kept directory from before manifests is shown as never replayed."""
    from partition_server.wal import describe_kept
    from tests.conftest import atomlog

    _lose_a_directory_then_put_it_back(tmp_path, 3, 1)
    [kept] = (tmp_path / "wal").glob("kept-*")
    shutil.copytree(kept, tmp_path / "wal" / "kept-1", ignore=shutil.ignore_patterns("kept.json"))
    rows = describe_kept(tmp_path / "wal", tmp_path / "p")
    fates = [(r["kept"], r["partition"], r["status"], r["first_offset"], r["end_offset"],
              r["batches"], r["directory"]) for r in rows]
    assert fates == [
        ("kept-1", "t-0", "no-manifest", 0, 2, 1, "present"),
        ("kept-1", "t-1", "no-manifest", 0, 6, 3, "present"),
        (kept.name, "t-0", "done", 0, 2, 1, "present"),  # replayed by the start that kept it
        (kept.name, "t-1", "pending", 0, 6, 3, "present"),  # its directory is back
    ]
    assert rows[3]["kept_at_ms"] == int(kept.name.removeprefix("kept-"))
    (tmp_path / "p" / "t-1" / "data-loss.json").write_text("{}")  # (only looked at)
    assert describe_kept(tmp_path / "wal", tmp_path / "p")[3]["directory"] == "data-loss"
    (tmp_path / "p" / "t-1" / "data-loss.json").unlink()

    # The command reads a server's data directory (wal/ and partitions/ under it).
    server = tmp_path / "server"
    server.mkdir()
    (tmp_path / "wal").rename(server / "wal")
    (tmp_path / "p").rename(server / "partitions")
    before = sorted(str(p) for p in server.rglob("*"))
    assert json.loads(atomlog("partition", "kept-frames", str(server), "-o", "json").stdout) \
        == rows
    table = atomlog("partition", "kept-frames", str(server)).stdout
    assert "pending" in table and "no-manifest" in table
    assert sorted(str(p) for p in server.rglob("*")) == before  # nothing changed
    refused = atomlog("partition", "kept-frames", "ps-9", "--data-dir", str(tmp_path),
                      check=False)
    assert refused.returncode == 1 and "no server data directory" in refused.stderr


def test_a_start_replays_a_write_ahead_file_larger_than_it_holds_in_memory(tmp_path):
    """A start reads one write-ahead segment at a time and replays a partition a chunk at
    a time: its plan keeps where each batch is, not the batch. (It used to hold every
    segment's bytes until the replay ended, so a file grown towards
    partition.wal_max_bytes, 2 GiB, while checkpoints stalled took that much memory at the
    next start.) Also for frames kept aside: a directory that comes back, holding the
    first of its batches already, is compared with the frames and continued a chunk at a
    time."""
    import tracemalloc

    from partition_server.log import PartitionLog
    from partition_server.wal import REPLAY_CHUNK_BYTES, segment_path

    wal_dir, data = tmp_path / "wal", tmp_path / "p"
    wal_dir.mkdir()
    names = [f"t-{i}" for i in range(4)]
    segment_bytes, segments = 8 << 20, 6
    written: dict[str, list[bytes]] = {name: [] for name in names}
    next_offset = dict.fromkeys(names, 0)
    for sequence in range(segments):
        frames: list[bytes] = []
        size = 0
        while size < segment_bytes:
            for index, name in enumerate(names):  # the partitions' frames interleaved
                batches = []
                for _ in range(16):
                    offset = next_offset[name]
                    batches.append(stamped(batch(index + 1, offset, b"v" * 4000), offset))
                    next_offset[name] = offset + 2
                written[name] += batches
                frame = encode_frame(DATA, name, offset - 30, b"".join(batches))
                frames.append(frame)
                size += len(frame)
        segment_path(wal_dir, sequence).write_bytes(b"".join(frames))
    total = sum(segment_path(wal_dir, s).stat().st_size for s in range(segments))
    for name in names[:3]:  # t-3's directory is missing: its frames are kept aside
        (data / name).mkdir(parents=True)
    config = LogConfig()

    def replay() -> tuple[dict, int]:
        tracemalloc.start()
        try:
            replayed = WriteAheadLog(wal_dir).recover_all(data, config)
            return replayed, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def logged(name: str) -> list[bytes]:
        with PartitionLog(data / name, config) as log:
            held, _ = log.read(0, 1 << 40, log.log_end_offset)
        return [bytes(held[position:position + header.size])
                for position, header in iter_batches(held)]

    replayed, peak = replay()
    batches = len(written["t-0"])
    assert replayed == {"t-0": batches, "t-1": batches, "t-2": batches}
    assert [logged(name) == written[name] for name in names[:3]] == [True] * 3
    # A segment read, its frames decoded, and a chunk of batches read back: under half of
    # the file's 50 MiB.
    bound = 2 * segment_bytes + REPLAY_CHUNK_BYTES
    assert peak < bound < total / 2, (peak, bound, total)
    assert len(list(wal_dir.glob("kept-*/*.wal"))) == segments
    # t-3 comes back holding its first 100 batches: the kept frames continue it.
    with PartitionLog(data / "t-3", config) as log:
        log.append_copied([(b, parse_header(b)) for b in written["t-3"][:100]])
        log.flush()
    replayed, peak = replay()
    assert replayed == {} and logged("t-3") == written["t-3"]
    assert peak < bound, (peak, bound, total)
    assert not list(wal_dir.glob("kept-*"))


async def damage_found_at_offset_4(tmp_path, owner: PartitionOwner) -> None:
    """A byte of t-0's batch at offset 4 flipped, found by a read: the partition goes to
    DATA_LOSS."""
    from tests.test_replication import flip_byte_in_batch

    [segment] = sorted((tmp_path / "p" / "t-0").glob("*.log"))
    flip_byte_in_batch(segment, 2)  # the batch at offset 4
    with pytest.raises(AtomlogError):
        owner.read(0, 1 << 20)
    for _ in range(300):
        await asyncio.sleep(0.01)
        if owner.state is State.DATA_LOSS:
            break


def test_an_operator_s_recovery_from_a_loss_below_the_frames_brings_the_partition_back(
        tmp_path):
    """A partition loaded at 10 (its BASE frame), written on to 20, then damage found by a
    read at offset 4, below where its frames begin. A log loaded in DATA_LOSS gets no
    write-ahead tap, so the operator's cut to 4 (RecoverPartition) wrote no CUT frame, and
    the reload's replay found the log ending below the frames: DATA_LOSS again ("the
    checkpointed data is missing"); only a restart got out. Now the cut is framed first,
    and the partition comes back at 4."""
    async def scenario():
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()
        await produce_run(node.owners[0], 0, 10)
        await node.close()
        node = Node(tmp_path, 1, checkpoint_ms=60_000)
        await node.start()  # loaded at 10: its frames begin there
        owner = node.owners[0]
        await produce_run(owner, 10, 20)
        await damage_found_at_offset_4(tmp_path, owner)
        assert owner.state is State.DATA_LOSS
        loss = owner.log.data_loss
        assert loss.offset == 4
        await owner.recover_data_loss(loss.path, 4)
        assert owner.state is State.ONLINE and owner.log.high_watermark == 4
        b = batch(2, 0)
        assert (await owner.produce([(b, parse_header(b))]))[0].base_offset == 4
        await node.close()
        node = Node(tmp_path, 1)  # and a restart replays the same
        await node.start()
        assert node.owners[0].state is State.ONLINE
        assert node.owners[0].log.high_watermark == 6
        await node.close()

    asyncio.run(scenario())


def test_an_accepted_data_loss_cuts_subscription_cursors_back_to_the_new_log_end(tmp_path):
    """Acks of offsets 4-19 stood above the log after the operator's cut to 4, so the
    messages written there next counted as acknowledged and were never delivered. Now the
    load after the cut journals each cursor's cut (before serving), and a restart keeps
    it: the new messages are delivered."""
    def delivered(owner) -> list[int]:
        def read(offset, max_bytes):
            data, next_offset, _ = owner.read(offset, max_bytes)
            return data, next_offset
        _, delivery = owner.subscriptions.receive(
            "s", "c", read, owner.log.high_watermark, 0, 30_000, 1 << 20, 100)
        return sorted(o for s, e in delivery.delivered for o in range(s, e))

    async def scenario():
        node = Node(tmp_path, 1)
        await node.start()
        owner = node.owners[0]
        await owner.subscriptions.create("s", 0)
        await produce_run(owner, 0, 20)
        await owner.subscriptions.ack("s", 2, [(6, 8)], None, limit=20)
        await owner.subscriptions.ack("s", 0, [(12, 16)], PartitionTxnId(3, 9), limit=20)
        await damage_found_at_offset_4(tmp_path, owner)
        await owner.recover_data_loss(owner.log.data_loss.path, 4)
        assert owner.state is State.ONLINE and owner.log.high_watermark == 4
        cursor = owner.subscriptions.store.cursor("s")
        assert (cursor.cumulative_end, cursor.individual_ranges(),
                cursor.pending_acks()) == (2, (), (PendingAck(PartitionTxnId(3, 9), 0, ()),))
        for sequence in range(0, 12, 2):  # offsets 4-15 again: new messages
            b = batch(2, sequence)
            await owner.produce([(b, parse_header(b))])
        assert delivered(owner) == list(range(2, 16))
        await node.close()
        node = Node(tmp_path, 1)  # the cut was journaled: a restart keeps it
        await node.start()
        assert node.owners[0].subscriptions.store.cursor("s").cumulative_end == 2
        assert delivered(node.owners[0]) == list(range(2, 16))
        await node.close()

    asyncio.run(scenario())


def test_a_failed_round_on_a_segment_already_trimmed_still_answers_the_rounds_after(tmp_path):
    """A round's fsync failed after its segment was trimmed (its partitions made durable
    by a roll or a close meanwhile): the failure's bookkeeping raised KeyError, so that
    round was never marked done and no later round was ever answered: every partition
    on the file hung. Now the later rounds are answered."""
    from partition_server import durability
    from partition_server.wal import _Round

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        mine, later = durability.SyncTicket(), durability.SyncTicket()
        first, second = _Round([(mine, "a")], 99, 0.0), _Round([(later, "b")], 99, 0.0)
        wal._rounds.extend([first, second])
        failed, fine = durability.SyncTicket(), durability.SyncTicket()
        failed.finish(OSError(5, "Input/output error"))
        fine.finish(None)
        wal._synced(second, fine)
        wal._synced(first, failed)  # (segment 99 is in no bookkeeping any more)
        assert mine.done() and later.done() and not wal._rounds
        await wal.close()

    asyncio.run(scenario())


def test_a_partition_in_data_loss_no_longer_holds_the_file_and_its_frames_are_kept_aside(
        tmp_path):
    """A partition that went to DATA_LOSS while the server ran was never checkpointed
    again, so every segment from its last checkpoint on stayed: the file grew to
    partition.wal_max_bytes, and then every partition on the server (the TC log's too)
    was refused every write until a restart. Now its frames no longer hold the segments;
    the segments holding some are kept aside for it (`kept-*`, as a start keeps them)
    when they go."""
    import json

    async def scenario():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        wal, lost, other = node.wal, node.owners[0], node.owners[1]
        wal.segment_bytes, wal.max_bytes = 8 << 10, 32 << 10  # (a round: a page at least)
        for owner in node.owners:
            b = batch(1, 0)
            await owner.produce([(b, parse_header(b))])
        (lost.directory / "data-loss.json").write_text(
            '{"file": "00000000000000000000.log", "position": 0, "offset": 0, '
            '"detail": "test", "detected_unix_ms": 1}')
        # Its checkpoint's fsync failed (its close then fsyncs nothing: its frames are
        # all that holds [0, 2) durably), and its reload finds a loss marker.
        lost.log.fail("an fsync failed")
        lost._checkpoint_failed(OSError(5, "Input/output error"))  # it reloads
        for _ in range(200):
            await asyncio.sleep(0.01)
            if lost.state is State.DATA_LOSS:
                break
        assert lost.state is State.DATA_LOSS
        sequence = await fill_until_refused(other, 2)
        await checkpointed_and_trimmed(wal, other)
        assert len(wal._ledger.segments) == 1  # only the active one is left
        assert wal.full() is None
        b = batch(1, sequence)
        await other.produce([(b, parse_header(b))])  # taken again
        kept = list((tmp_path / "wal").glob("kept-*"))
        assert len(kept) == 1 and list(kept[0].glob("*.wal"))
        assert json.loads((kept[0] / "kept.json").read_text()) == {
            "missing": [], "data_loss": ["t-0"]}
        await node.close()

    asyncio.run(scenario())


def test_a_round_waits_for_a_cut_fsync_in_flight_and_never_counts_its_failed_segment(
        tmp_path):
    """One fsync of the write-ahead file at a time. A CUT (or BASE) frame's fsync runs on
    a worker thread; a round asked for meanwhile used to run beside it, on the same open
    file, and Linux reports a write-back error to the first fsync that looks: the round's
    could return success, and be answered, while the cut's failed and had not yet
    poisoned the segment (an acknowledgement of frames that may be lost). Now the round
    waits until the cut's fsync ended and recorded its failure; it then writes its frames
    into a new segment (the failed one takes no more) and counts nothing of the failed
    one. (Before 2026-12-05 the failed cut also marked the wrong segment, the one active
    after a roll, when the loop had rolled meanwhile; no roll can come between now.)"""
    import threading

    release = threading.Event()
    blocked = threading.Event()
    loop_thread = []
    seen_during_cut = []

    def fsync(fd):
        if threading.get_ident() != loop_thread[0] and not blocked.is_set():
            blocked.set()
            release.wait(10)
            raise OSError(5, "Input/output error")
        os.fsync(fd)

    async def scenario():
        loop_thread.append(threading.get_ident())
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000, fsync=fsync)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)
        assert await synced(wal, "a") is None
        first = wal._sequence
        cut = asyncio.ensure_future(asyncio.to_thread(wal.write_cut, "a", 0))
        while not blocked.is_set():
            await asyncio.sleep(0.005)
        wal.queue(b"b", "b", 0, stamped(batch(1, 0), 0), 2)
        round_b = asyncio.ensure_future(synced(wal, "b"))
        await asyncio.sleep(0.3)
        seen_during_cut.append(round_b.done())
        release.set()
        with pytest.raises(OSError):
            await cut
        assert await round_b is None  # its frames in a new segment, fsynced
        assert wal._sequence != first
        assert first in wal._poisoned and wal._sequence not in wal._poisoned
        assert "a" in wal._lost and "b" not in wal._lost
        assert "b" not in wal._names_in.get(first, set())
        await wal.close()

    asyncio.run(scenario())
    assert seen_during_cut == [False], "the round ran beside the cut's fsync"


def test_rounds_run_one_fsync_at_a_time(tmp_path):
    """Rounds asked for while one round's fsync runs wait for it (then go together): no
    two fsyncs of the file are ever submitted at once."""
    outstanding, most, submitted = [0], [0], [0]

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        class Counting:  # the barrier's LogSync, counting the fsyncs out at once
            def __init__(self, sync):
                self.sync = sync

            def __getattr__(self, name):
                return getattr(self.sync, name)

            def submit(self, fd, callback):
                outstanding[0] += 1
                submitted[0] += 1
                most[0] = max(most[0], outstanding[0])

                def ended():
                    outstanding[0] -= 1
                    callback()
                return self.sync.submit(fd, ended)

        wal._sync = Counting(wal._sync)
        waits = []
        for i in range(40):
            name = f"p{i % 7}"
            wal.queue(name.encode(), name, i, stamped(batch(1, 0), i), i + 2)
            waits.append(asyncio.ensure_future(synced(wal, name)))
            if i % 3 == 0:
                await asyncio.sleep(0)  # a round may start; the next ones ask meanwhile
        assert await asyncio.gather(*waits) == [None] * 40
        await wal.close()

    asyncio.run(scenario())
    assert most[0] == 1 and submitted[0] >= 2, (most, submitted)


def test_a_round_whose_fsync_could_not_begin_fails_its_flushes_and_the_next_round_runs(
        tmp_path):
    """A round's submit that raised anything but OSError (a worker thread that could
    not start) left the file's fsync turn taken for good: every later flush hung, and
    every CUT or BASE frame timed out. Now the round's flushes fail and the turn is
    free for the next round."""

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        real = wal._sync

        class Refusing:
            def __getattr__(self, name):
                return getattr(real, name)

            def submit(self, fd, callback):
                raise RuntimeError("can't start new thread")

        wal._sync = Refusing()
        wal.queue(b"a", "a", 0, stamped(batch(1, 0), 0), 2)
        failed = await asyncio.wait_for(synced(wal, "a"), 10)  # (before: never answered)
        assert isinstance(failed, OSError) and "could not begin" in str(failed)
        wal._sync = real
        wal.queue(b"a", "a", 2, stamped(batch(1, 2), 2), 4)
        assert await asyncio.wait_for(synced(wal, "a"), 10) is None
        await asyncio.to_thread(wal.write_cut, "a", 3)  # the turn is free for a worker too
        await wal.close()

    asyncio.run(scenario())


def test_a_trimmed_segment_that_could_not_be_deleted_goes_before_any_newer_one(
        tmp_path, monkeypatch):
    """A trim took segments out of its books and then failed to unlink them (EIO, a
    read-only remount): they stayed on disk forgotten, later trims deleted newer ones,
    and the hole between made a start's replay take the old frames for lost ones (a
    false DATA_LOSS). Now the next trim deletes them first, and nothing newer goes
    while they stay."""
    import partition_server.wal as wal_module

    real = wal_module._unlink_segments
    failing = [2]

    def unlink(directory, sequences):
        if failing[0]:
            failing[0] -= 1
            raise OSError(30, "Read-only file system")
        real(directory, sequences)

    monkeypatch.setattr(wal_module, "_unlink_segments", unlink)

    async def one_segment(wal, offset):
        wal.queue(b"a", "a", offset, stamped(batch(1, offset), offset), offset + 2)
        assert await synced(wal, "a") is None
        wal._size = wal.segment_bytes  # the next round rolls

    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal", checkpoint_ms=60_000)
        await asyncio.to_thread(wal.recover_all, tmp_path / "p", SETTINGS.log)
        await wal.start()
        for offset in (0, 2):
            await one_segment(wal, offset)
        await one_segment(wal, 4)
        await one_segment(wal, 6)  # segments 0, 1, 2 sealed; 3 active
        wal.checkpointed("a", 4)  # 0 and 1 may go
        await wal._trim()  # the unlink fails
        assert set(list_segments(wal.directory)) >= {0, 1}
        wal.checkpointed("a", 6)  # 2 may go too
        await wal._trim()  # still failing: 2 is not deleted before them
        assert set(list_segments(wal.directory)) >= {0, 1, 2}
        await wal._trim()  # it works now: the old ones first, then 2
        await wal._trim()
        assert not {0, 1, 2} & set(list_segments(wal.directory))
        await wal.close()

    asyncio.run(scenario())


def test_a_failed_round_under_fatal_frames_stops_the_server_and_no_later_round_answers(
        tmp_path):
    """The commit lane's one-round step (coordinator.lane_one_round) writes a commit's
    stages and then its decision in one step as fatal frames (WalTap.fatal), so that a
    durable decision implies durable stages. After a failed round each partition's reload
    would read the file at its own moment, and the kernel may drop a failed fsync's
    pages between two reads, so a failed write or fsync of fatal frames stops the server
    (`on_fatal`: the process exits, the next start replays the file in one pass). A
    failed round of ordinary frames still reloads its partitions, the server going on."""
    async def scenario():
        node, stopped, _ = await recording_node(tmp_path, 2)
        refusing = node.wal._sync = RefusingRounds(node.wal)
        first, second = node.owners
        # An ordinary round fails: its partition reloads, nothing stops.
        lost = batch(1, 0)
        with pytest.raises(AtomlogError, match="PARTITION_LOADING|injected"):
            await first.produce([(lost, parse_header(lost))])
        for _ in range(200):
            await asyncio.sleep(0.01)
            if first.state is State.ONLINE:
                break
        assert first.state is State.ONLINE and stopped == []
        again = batch(1, 0, b"again" * 8)
        assert (await first.produce([(again, parse_header(again))]))[0].base_offset == 0
        # Both owners written in one gathering step: fatal frames. Their round fails.
        refusing.failing += 1
        batches = [batch(2, 0), batch(3, 0)]
        gathering = owner_module.gather()
        try:
            futures = [owner.queue_produce([(b, parse_header(b))])
                       for owner, b in zip(node.owners, batches)]
            assert list(gathering.owners) == node.owners  # noted, not woken
            assert all(owner.write_gathered() for owner in node.owners)
            assert [f.done() for f in futures] == [False, False]  # written, not durable
        finally:
            gathering.close()  # their flushes begin: one round
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(o, BaseException) for o in outcomes), outcomes
        assert len(stopped) == 1 and "injected" in str(stopped[0])
        # No later round is answered with success (the process would be gone).
        ticket = node.wal.sync("t-1", None)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if ticket.done():
                break
        assert ticket.done() and isinstance(ticket.exception(), OSError)
        assert len(stopped) == 1
        for owner in node.owners:
            owner._task.cancel()
        await node.wal.close()

    asyncio.run(scenario())


async def recording_node(root: Path, partitions: int, held: bool = False):
    """A started Node whose write-ahead file records its stops instead of exiting: (node,
    the stops' errors, HeldRounds when `held`: each round's fsync waits for the test)."""
    node = Node(root, partitions, checkpoint_ms=60_000)
    await node.start()
    stopped: list = []
    node.wal.on_fatal = stopped.append
    rounds = None
    if held:
        rounds = node.wal._sync = HeldRounds()
    return node, stopped, rounds


async def stopped_once(stopped: list, why: str) -> None:
    """Wait (up to 2 s) for a recording node's one stop, whose error says `why`."""
    for _ in range(200):
        await asyncio.sleep(0.01)
        if stopped:
            break
    assert len(stopped) == 1 and why in str(stopped[0])


async def gathered_write(owner: PartitionOwner, data: bytes):
    """`data` produced on `owner` in a gathering of its own, written there (fatal frames)
    once its task is parked; the produce's future."""
    for _ in range(100):
        await asyncio.sleep(0)
        if parked(owner):
            break
    gathering = owner_module.gather()
    try:
        written = owner.queue_produce([(data, parse_header(data))])
        assert owner.write_gathered()
    finally:
        gathering.close()
    return written


def parked(owner: PartitionOwner) -> bool:
    """Whether the owner's task waits for work (so it may write in a gathering)."""
    return owner._wake is not None and not owner._wake.done()


class HeldRounds:
    """The write-ahead file's LogSync: each round's fsync waits until the test ends it
    (`finish(error)`, oldest first)."""

    def __init__(self):
        self.held: list = []

    def submit(self, fd, wake):
        ticket = durability.SyncTicket(wake)
        self.held.append((ticket, wake))
        return ticket

    def finish(self, error=None) -> None:
        ticket, wake = self.held.pop(0)
        ticket.finish(error)
        wake()


def test_an_earlier_round_failing_before_fatal_frames_are_durable_stops_the_server(
        tmp_path):
    """Fatal frames (a commit's stages and decision, written in the lane's step) are
    not yet durable, and the fsync of an earlier, ordinary round fails first (which loses
    the partitions framed in its segment: they would reload and cut back the stage,
    while the decision's frame goes into the next segment's round and succeeds): the
    server stops. After the fatal frames are durable it does not
    (`test_durable_fatal_frames_leave_failures_to_the_partitions_reloads`); a partition
    of theirs failing on its own reloads keeping them
    (`test_a_reload_keeps_a_gathered_write_its_decision_depends_on`)."""
    async def scenario():
        node, stopped, rounds = await recording_node(tmp_path, 3, held=True)
        other, *lane = node.owners
        ordinary = batch(1, 0)
        earlier = other.queue_produce([(ordinary, parse_header(ordinary))])
        for _ in range(100):
            await asyncio.sleep(0)
            if rounds.held and all(parked(owner) for owner in lane):
                break
        assert len(rounds.held) == 1  # the ordinary round's fsync runs
        gathering = owner_module.gather()
        try:
            staged = [owner.queue_produce([(b, parse_header(b))])
                      for owner, b in zip(lane, [batch(2, 0), batch(3, 0)])]
            assert all(owner.write_gathered() for owner in lane)
        finally:
            gathering.close()
        assert node.wal.fatal_exposed()  # the lane's two, not yet durable; not the other's
        assert all(owner._gathered_to > owner.log.high_watermark for owner in lane)
        assert other._gathered_to == -1
        rounds.finish(OSError(5, "injected"))
        await stopped_once(stopped, "injected")
        while rounds.held:  # (a reload's worker waits for the fsync turn)
            rounds.finish(OSError(5, "after the stop"))
        for future in [earlier, *staged]:
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        for owner in node.owners:
            owner._task.cancel()
        await node.wal.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("round_ends", ["before", "after"])
def test_a_reload_keeps_a_gathered_write_its_decision_depends_on(tmp_path, round_ends):
    """An owner with a gathered write (a stage whose decision was written in the same
    step) fails closed before its flush moved the high watermark (a failed checkpoint
    raised in its task: a full disk's snapshot or recovery-point write goes the same
    way), with the write's round already succeeded or still on its way. Its reload would
    cut back to the high watermark, below the stage the decision depends on: it keeps
    the write instead (the replay rewrites it from its frames, made durable by the
    round or by the load's BASE frame), and the server goes on. (Before, the server
    stopped.)"""
    async def scenario():
        node, stopped, rounds = await recording_node(tmp_path, 1, held=True)
        owner = node.owners[0]
        written = await gathered_write(owner, batch(1, 0))
        for _ in range(100):
            await asyncio.sleep(0)
            if rounds.held:
                break
        owner._checkpoint_failed(OSError(5, "injected"))  # raised in the task, next
        if round_ends == "before":
            rounds.finish()  # the round succeeds in the same step
            assert not node.wal.fatal_exposed() and owner.log.high_watermark == 0
        for _ in range(50):
            await asyncio.sleep(0.01)
            if rounds.held and owner.state is not State.ONLINE:
                rounds.finish()  # (a reload's worker waits for the fsync turn)
        for _ in range(200):
            await asyncio.sleep(0.01)
            while rounds.held:
                rounds.finish()
            if owner.state is State.ONLINE and owner.log is not None and \
                    owner.log.log_end_offset == 2:
                break
        assert stopped == [] and owner.state is State.ONLINE
        assert owner.log.log_end_offset == owner.log.high_watermark == 2
        assert [h.base_sequence for h, _ in read_headers(owner)] == [0]
        written.add_done_callback(lambda f: f.cancelled() or f.exception())
        again = batch(1, 2)
        pending = asyncio.ensure_future(owner.produce([(again, parse_header(again))]))
        while not pending.done():
            await asyncio.sleep(0.01)
            while rounds.held:
                rounds.finish()
        assert pending.result()[0].base_offset == 2
        await node.close()

    asyncio.run(scenario())


def test_a_reload_that_cannot_bring_a_gathered_write_back_stops_the_server(tmp_path):
    """The safety net under the rule above: a reload that ends below the owner's last
    gathered write (its frames did not bring it back) stops the server."""
    async def scenario():
        node, stopped, _ = await recording_node(tmp_path, 1)
        owner = node.owners[0]
        written = await gathered_write(owner, batch(1, 0))
        await written
        owner._gathered_to = 10  # (as if a write up to 10 were in a gathering)
        owner._checkpoint_failed(OSError(5, "injected"))
        await stopped_once(stopped, "below its write")
        # Stopped before a BASE frame voided the partition's frames: a start replays the
        # write from them.
        frames = wal_module.plan(wal_module.read_frames(node.wal.directory))["t-0"]
        assert [(base, last) for base, last, _ in frames.batches] == [(0, 1)]
        await node.close()

    asyncio.run(scenario())


def test_durable_fatal_frames_leave_failures_to_the_partitions_reloads(tmp_path):
    """Once the round carrying fatal frames succeeded, a later failure reloads the
    partition concerned, as for any frames: the server goes on."""
    async def scenario():
        node, stopped, _ = await recording_node(tmp_path, 1)
        owner = node.owners[0]
        written = await gathered_write(owner, batch(1, 0))
        assert (await written)[0].base_offset == 0
        assert not node.wal.fatal_exposed()
        owner._checkpoint_failed(OSError(5, "injected"))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if owner.state is State.ONLINE and owner.log is not None:
                break
        assert owner.state is State.ONLINE and stopped == []
        again = batch(1, 2)
        assert (await owner.produce([(again, parse_header(again))]))[0].base_offset == 2
        await node.close()

    asyncio.run(scenario())


async def own_fsyncs_owner(directory: Path) -> PartitionOwner:
    """Partition t-0 started on its own fsyncs (not under a write-ahead file), its
    recovery point written at its load only."""
    owner = PartitionOwner("t", 0, directory, OwnerSettings(
        log=LogConfig(segment_bytes=16 << 10, recovery_point_interval_ms=3_600_000),
        durability=durability.FSYNC))
    await owner.start()
    return owner


def power_cut(owner: PartitionOwner) -> None:
    """A power cut under a lone owner: nothing more written, nothing closed cleanly."""
    owner._task.cancel()
    owner.log.fail("power cut")
    owner.log.close()


def tails_cut() -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("atomlog_wal_unframed_tails_cut_total") or 0.0


class WrittenBack:
    """A power cut's "random": the partitions' files keep all they were given (the kernel
    had written their pages back), the write-ahead file loses all it may lose."""

    def __init__(self, partitions: int):
        self.partitions = partitions  # Node.crash cuts the partitions' files first

    def randint(self, low: int, high: int) -> int:
        self.partitions -= 1
        return high if self.partitions >= 0 else low


async def _frames_only_of_the_other(node: Node, written: PartitionOwner,
                                    other: PartitionOwner, sequence: int = 0) -> int:
    """Checkpoint and trim until no segment kept holds a frame of `written` (the other
    partition's writes, producer 1's from `sequence` on, roll small segments past
    them). Returns the other's next sequence."""
    wal = node.wal
    wal.segment_bytes = 4 << 10
    for _ in range(200):
        names = {frame.name for frame in wal_module.read_frames(wal.directory)}
        if written.name not in names:
            return sequence
        await produce_run(other, sequence, sequence + 8)
        sequence += 8
        wal.checkpoint()
        await asyncio.sleep(0.02)
        await wal._trim()
    raise AssertionError("the frames of the written partition were never trimmed")


async def trimmed_node(tmp_path: Path, upto: int, settings: OwnerSettings | None = None
                       ) -> tuple[Node, PartitionOwner, PartitionOwner, int]:
    """A started Node of two partitions: the first written to offset `upto` (producer 1,
    acknowledged), then every frame of it checkpointed and trimmed; (node, that
    partition, the other, the other's next sequence)."""
    node = Node(tmp_path, 2, checkpoint_ms=60_000, settings=settings)
    await node.start()
    written, other = node.owners
    await produce_run(written, 0, upto)
    return node, written, other, await _frames_only_of_the_other(node, written, other)


def test_a_write_whose_round_a_power_cut_lost_is_cut_where_no_frame_names_its_partition(
        tmp_path):
    """docs/coordinator.md, "One round a commit": a partition whose frames were all
    checkpointed and trimmed is written to, and a power cut loses that round while the
    kernel had already written the partition file's page back. Nothing in the write-ahead
    file names the partition; the write was never acknowledged. The start cuts it back to
    where the file's listing of checkpoints (CHECKPOINTS_FILE, written before every trim)
    says it was durable. (Before, its valid tail was kept: a commit's decision written so
    to a TC log outlived its stages, whose frames the same round lost.)"""
    async def scenario():
        node, written, other, _ = await trimmed_node(tmp_path, 40)  # 0-39 acknowledged
        assert written.log.durable_offset == 40
        durable_wal = wal_sizes(node.wal)
        b = batch(1, 40)
        in_flight = asyncio.ensure_future(written.produce([(b, parse_header(b))]))
        for _ in range(3):
            await asyncio.sleep(0)
        assert written.log.log_end_offset == 42  # in its file, not yet acknowledged
        await node.crash(WrittenBack(2), durable_wal)
        in_flight.cancel()
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        cut_before = tails_cut()
        await node.start()
        assert tails_cut() == cut_before + 1
        written = node.owners[0]
        assert written.log.log_end_offset == 40
        assert [header.base_sequence for header, _ in read_headers(written)] == list(
            range(0, 40, 2))
        await node.close()

    asyncio.run(scenario())


def test_a_start_cuts_no_acknowledged_write_whose_recovery_point_lagged_its_trim(tmp_path):
    """The partitions write their recovery points at most once a second (not synced):
    the listing of checkpoints, not a recovery point, says how far a partition whose
    frames were trimmed is durable, so the cut of a tail no frame covers never reaches
    what was acknowledged."""
    async def scenario():
        slow = OwnerSettings(log=LogConfig(segment_bytes=16 << 10,
                                           recovery_point_interval_ms=3_600_000),
                             durability=durability.WAL)
        node, written, other, sequence = await trimmed_node(tmp_path, 20, slow)  # point 20
        await produce_run(written, 20, 40)
        await _frames_only_of_the_other(node, written, other, sequence)  # not written again
        assert written.log.durable_offset == 40
        await node.crash(WrittenBack(2), wal_sizes(node.wal))
        recovery_point = json.loads((written.directory / "recovery-point.json")
                                    .read_bytes())["offset"]
        assert recovery_point < 40  # (else this test shows nothing)
        node = Node(tmp_path, 2, checkpoint_ms=60_000, settings=slow)
        await node.start()
        assert node.owners[0].log.log_end_offset == 40
        await node.close()

    asyncio.run(scenario())


def test_a_start_in_wal_mode_keeps_the_tail_a_start_in_another_mode_made_durable(tmp_path):
    """A partition the write-ahead file never listed (the last start was in fsync mode,
    whose flushes fsync the partition's own file) keeps its tail above its recovery
    point: only a listed partition's tail without frames is cut. And a start in another
    mode over a listing drops the listing, so that the tails it writes are never cut
    later by a stale one."""
    from partition_server.wal import CHECKPOINTS_FILE, replay_leftover

    async def in_wal_mode():
        node, *_ = await trimmed_node(tmp_path, 20)
        await node.close()

    asyncio.run(in_wal_mode())
    assert (tmp_path / "wal" / CHECKPOINTS_FILE).exists()
    replay_leftover(tmp_path / "wal", tmp_path / "p", SETTINGS.log)
    assert not (tmp_path / "wal" / CHECKPOINTS_FILE).exists()

    async def in_fsync_mode():
        owner = await own_fsyncs_owner(tmp_path / "p" / "t-0")
        await produce_run(owner, 20, 40)  # acknowledged: fsynced in its own file
        assert owner.log.high_watermark == 40
        power_cut(owner)

    asyncio.run(in_fsync_mode())

    async def in_wal_mode_again():
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        assert node.owners[0].log.log_end_offset == 40
        await node.close()

    asyncio.run(in_wal_mode_again())


def test_a_listing_that_cannot_be_written_is_removed_and_the_trims_go_on(tmp_path,
                                                                          monkeypatch):
    """A full disk refuses the listing of checkpoints: the old one goes (a stale listing
    could cut what a checkpoint since acknowledged), the segments are deleted all the
    same (before, every later trim waited for the listing and the file grew until it
    refused every write), and the close does not fail."""
    from partition_server.wal import CHECKPOINTS_FILE

    async def scenario():
        node, written, other, sequence = await trimmed_node(tmp_path, 20)
        assert (tmp_path / "wal" / CHECKPOINTS_FILE).exists()

        def full(directory: Path, listing: dict) -> None:
            raise OSError(errno.ENOSPC, "injected: no space left")

        monkeypatch.setattr(wal_module, "write_listing", full)
        await produce_run(written, 20, 40)
        await _frames_only_of_the_other(node, written, other, sequence)  # trimmed anyway
        assert not (tmp_path / "wal" / CHECKPOINTS_FILE).exists()
        await node.close()
        assert list_segments(tmp_path / "wal") == []

    asyncio.run(scenario())


def test_a_partition_closed_under_the_file_and_written_on_its_own_fsyncs_is_never_cut(
        tmp_path):
    """A partition's owner under the write-ahead file closes (its topic deleted and made
    again with copies, the partition moved away and back): the same name is then written
    on its own fsyncs, beside a file that goes on trimming. The listing no longer names
    it, so a start after a power cut keeps what those fsyncs made durable and
    acknowledged."""
    async def scenario():
        node, written, other, sequence = await trimmed_node(tmp_path, 20)
        await written.close()  # a clean close: the file's frames of it are checkpointed
        own = await own_fsyncs_owner(tmp_path / "p" / "t-0")
        await produce_run(own, 20, 60)  # acknowledged: fsynced in its own file
        assert own.log.high_watermark == 60
        for _ in range(3):  # the file trims on (its listing rewritten each time)
            await produce_run(other, sequence, sequence + 40)
            sequence += 40
            node.wal.checkpoint()
            await asyncio.sleep(0.05)
            await node.wal._trim()
        power_cut(own)
        node.owners = [other]
        await node.crash(WrittenBack(1), wal_sizes(node.wal))
        node = Node(tmp_path, 2, checkpoint_ms=60_000)
        await node.start()
        assert node.owners[0].log.log_end_offset == 60
        await node.close()

    asyncio.run(scenario())


def test_a_roll_ahead_of_its_round_counts_nothing_above_the_high_watermark(tmp_path):
    """A roll fsyncs the segment it seals, whose tail may be a write whose round has not
    ended: the checkpoint the file counts (and trims at), the listing's and the
    periodic recovery point stay at the high watermark, so a start cuts that write if
    its round is lost."""
    async def scenario():
        settings = OwnerSettings(log=LogConfig(segment_bytes=4 << 10), max_fsyncs_in_flight=2,
                                 durability=durability.WAL)
        node = Node(tmp_path, 1, checkpoint_ms=60_000, settings=settings)
        await node.start()
        rounds = node.wal._sync = HeldRounds()
        owner = node.owners[0]
        first = batch(1, 0, b"v" * 1_200)
        second = batch(1, 2, b"v" * 1_200)
        produced = [asyncio.ensure_future(owner.produce([(first, parse_header(first))]))]
        for _ in range(100):
            await asyncio.sleep(0)
            if rounds.held:
                break
        produced.append(asyncio.ensure_future(owner.produce([(second,
                                                               parse_header(second))])))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if owner.log.durable_offset > owner.log.high_watermark:
                break
        log_ = owner.log
        assert log_.durable_offset > log_.high_watermark == 0  # the roll ran ahead
        with node.wal._lock:
            assert node.wal._listing() == {"t-0": 0}
        assert node.wal._checkpointed.get("t-0", 0) == 0
        log_._recovery_point_written_ms = -(1 << 62)
        log_._maybe_write_recovery_point()
        await asyncio.sleep(0.05)
        assert json.loads((owner.directory / "recovery-point.json").read_bytes())[
            "offset"] == 0
        while rounds.held:
            rounds.finish()
            await asyncio.sleep(0.01)
        for pending in produced:
            await pending
        await node.close()

    asyncio.run(scenario())


class KeepingHalf:
    """A power cut's "random" where each file keeps all it was given half of the time
    (its pages written back), else is cut anywhere from its durable end: a uniform cut
    alone all but never keeps a file's last write whole."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def randint(self, low: int, high: int) -> int:
        return high if self.rng.random() < 0.5 else self.rng.randint(low, high)


async def one_round_commit(node: Node, k: int, sequences: list[int]):
    """A commit as the commit lane writes one (coordinator/lane.py, `_stage_in_step`): its
    stages on partitions 0 and 1, then its decision on partition 2 (a TC log's stand-in),
    in one gathering, so that their frames share a round, the decision's last. Each batch
    holds `k` in its values. The futures of the three writes, or None when a stage owner
    could not write in the step (no decision is written then, as in the lane)."""
    owners = node.owners[:3]
    for _ in range(100):
        if all(parked(owner) for owner in owners):
            break
        await asyncio.sleep(0)
    value = b"k%06d" % k
    gathering = owner_module.gather()
    try:
        stages = []
        for partition in (0, 1):
            b = batch(1, sequences[partition], value)
            stages.append(owners[partition].queue_produce([(b, parse_header(b))]))
            sequences[partition] += 2
        if not all(owners[partition].write_gathered() for partition in (0, 1)):
            return None
        decision = batch(2, sequences[2], value)
        stages.append(owners[2].queue_produce([(decision, parse_header(decision))]))
        sequences[2] += 2
        owners[2].write_gathered()
        return stages
    finally:
        gathering.close()


def commits_in(owner: PartitionOwner) -> set[int]:
    """The commit numbers `one_round_commit` wrote that the owner's log holds."""
    return {int(number) for _, data in read_headers(owner)
            for number in re.findall(rb"k(\d{6})", data)}


@pytest.mark.parametrize("seed", range(1, 13))
def test_a_decision_never_outlives_its_stages_across_random_power_cuts(tmp_path, seed):
    """The one-round commit's invariant under random power cuts (each file keeping
    anything from its durable end to all it was given, the write-ahead file anything
    from its last answered round on), with checkpoints and trims between them, so that
    partitions lose every frame now and then: after each restart a decision (partition
    2) is never in the log without both its stages (partitions 0 and 1), and every
    commit whose three writes were acknowledged is there whole. (A start once kept a
    decision written back to a partition with no frame left: the listing of
    checkpoints closed that.)"""
    rng = random.Random(seed)
    acked: set[int] = set()

    async def no_frames_of_the_commits(node: Node, filler: int) -> int:
        """Partition 3's writes roll the file's segments until a trim leaves no frame
        of partitions 0-2 (as a quiet TC log's frames all go); its next sequence."""
        wal = node.wal
        for _ in range(60):
            try:
                names = {frame.name for frame in wal_module.read_frames(wal.directory)}
            except FileNotFoundError:  # (a segment the checkpointer's trim just deleted)
                await asyncio.sleep(0.01)
                continue
            if not names & {owner.name for owner in node.owners[:3]}:
                break
            await produce_run(node.owners[3], filler, filler + 8)
            filler += 8
            wal.checkpoint()
            await asyncio.sleep(0.02)
            await wal._trim()
        return filler

    async def scenario():
        node = Node(tmp_path, 4, checkpoint_ms=rng.choice([20, 60_000]),
                    segment_bytes=rng.choice([8 << 10, 1 << 20]))
        await node.start()
        node.wal.segment_bytes = 8 << 10
        k = 0
        sequences = [0, 0, 0, 0]
        for cycle in range(4):
            for _ in range(rng.randint(5, 30)):
                written = await one_round_commit(node, k, sequences)
                if written is not None:
                    results = [(await pending)[0] for pending in written]
                    assert not any(isinstance(r, AtomlogError) for r in results), results
                    acked.add(k)
                k += 1
                if rng.random() < 0.3:
                    node.wal.checkpoint()
                    await asyncio.sleep(rng.choice([0.005, 0.03]))
                    await node.wal._trim()
            if rng.random() < 0.7:
                sequences[3] = await no_frames_of_the_commits(node, sequences[3])
            durable_wal = wal_sizes(node.wal)
            for _ in range(rng.randint(1, 3)):  # in flight at the crash
                written = await one_round_commit(node, k, sequences)
                k += 1
                for pending in written or ():
                    pending.add_done_callback(lambda f: f.cancelled() or f.exception())
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            await node.crash(KeepingHalf(rng), durable_wal)
            node = Node(tmp_path, 4, checkpoint_ms=node.checkpoint_ms,
                        segment_bytes=node.segment_bytes)
            await node.start()
            node.wal.segment_bytes = 8 << 10
            stages = [commits_in(node.owners[partition]) for partition in (0, 1)]
            decisions = commits_in(node.owners[2])
            assert decisions <= stages[0] & stages[1], (cycle, sorted(
                decisions - (stages[0] & stages[1])))
            assert acked <= decisions, (cycle, sorted(acked - decisions))
            for partition, owner in enumerate(node.owners):  # a producer goes on from
                found = [header.base_sequence for header, _ in read_headers(owner)]
                sequences[partition] = max(found, default=-2) + 2  # what its log holds
        await node.close()

    asyncio.run(scenario())
