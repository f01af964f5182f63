"""The partition owner restarts from its producer-state snapshot plus the log tail (not a
full replay), and the result equals a full replay. Its pipelined group commit never
acknowledges before the fsync covering a batch, keeps acks in log order, and fails
closed when an fsync fails."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest

from partition_server import log as log_module
from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.record_batch import Record, encode_batch, parse_header
from services.errors import AtomlogError


def batch(producer_id: int, sequence: int) -> bytes:
    return encode_batch([Record(b"k", b"v" * 50)] * 2, producer_id=producer_id,
                        producer_epoch=0, base_sequence=sequence, timestamp_ms=1_000)


async def produce(owner: PartitionOwner, batches: list[bytes]) -> None:
    for b in batches:
        await owner.produce([(b, parse_header(b))])


def test_restart_uses_the_snapshot_and_replays_only_the_tail(tmp_path):
    settings = OwnerSettings(log=LogConfig(segment_bytes=4_000), fsync=False,
                             snapshot_interval_batches=10, snapshot_interval_ms=3_600_000)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        await produce(owner, [batch(p, s) for s in range(0, 24, 2) for p in (7, 8)])  # 24
        await owner.close()  # a clean stop snapshots everything
        assert list((tmp_path / "t-0").glob("*.producer_snapshot"))

        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert again.replayed_batches == 0
        await produce(again, [batch(7, 24), batch(8, 24), batch(9, 0)])
        before_crash = again.producers.snapshot(again.log.high_watermark)
        again.log.close()  # a crash: no final snapshot (the periodic one covered 24)

        third = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await third.start()
        assert third.replayed_batches == 3
        assert third.producers.snapshot(third.log.high_watermark) == before_crash
        await third.close()

        # Without any snapshot, a full replay gives the same table.
        for path in (tmp_path / "t-0").glob("*.producer_snapshot"):
            path.unlink()
        full = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await full.start()
        assert full.replayed_batches == 27
        assert full.producers.snapshot(full.log.high_watermark) == before_crash
        await full.close()

    asyncio.run(scenario())


class GatedFsync:
    """An fsync for the owner that waits until the test releases it (or fails it), and
    records the file size when it was called: what it can make durable."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._outcomes: list[threading.Event] = []
        self._errors: dict[int, OSError] = {}
        self._lock = threading.Lock()
        self.open = False  # release every later call at once

    def __call__(self, fd: int) -> None:
        release = threading.Event()
        with self._lock:
            index = len(self.sizes)
            self.sizes.append(os.fstat(fd).st_size)
            self._outcomes.append(release)
            if self.open:
                release.set()
        assert release.wait(10), "the test never released this fsync"
        if index in self._errors:
            raise self._errors[index]
        os.fsync(fd)

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.sizes)

    def release(self, index: int, error: OSError | None = None) -> None:
        if error is not None:
            self._errors[index] = error
        self._outcomes[index].set()

    def release_all(self) -> None:
        with self._lock:
            self.open = True
            for event in self._outcomes:
                event.set()


def test_a_snapshot_beyond_the_recovered_log_is_removed_durably(tmp_path, monkeypatch):
    """A snapshot covering past the recovered log end (the data it describes was lost with
    a torn tail, or in an accepted loss) is removed at load. The unlink was not made
    durable: once the log grew past it again, a crash could bring it back to describe a
    history that is gone (answering a new batch as a duplicate, say). Now its directory
    is fsynced before the load goes on."""
    from partition_server import owner as owner_module
    from partition_server import producer_state

    settings = OwnerSettings(log=LogConfig(segment_bytes=4_000), fsync=False,
                             snapshot_interval_batches=10, snapshot_interval_ms=3_600_000)
    directory = tmp_path / "t-0"
    synced: list = []
    real = owner_module.fsync_directory

    def recording(path):
        synced.append(path)
        real(path)

    async def scenario():
        owner = PartitionOwner("t", 0, directory, settings)
        await owner.start()
        await produce(owner, [batch(7, s) for s in range(0, 8, 2)])  # 8 records
        await owner.close()
        [snapshot] = directory.glob("*.producer_snapshot")
        beyond = directory / producer_state.snapshot_file_name(500)
        beyond.write_bytes(snapshot.read_bytes())
        monkeypatch.setattr(owner_module, "fsync_directory", recording)
        again = PartitionOwner("t", 0, directory, settings)
        await again.start()
        assert not beyond.exists() and directory in synced
        await again.close()

    asyncio.run(scenario())


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def start(owner: PartitionOwner, b: bytes) -> asyncio.Future:
    return asyncio.ensure_future(owner.produce([(b, parse_header(b))]))


async def fail_loading(*requests: asyncio.Future) -> None:
    """Each request fails with PARTITION_LOADING (a failed fsync's: none is answered)."""
    for failed in requests:
        with pytest.raises(AtomlogError) as refused:
            await failed
        assert refused.value.reason == "PARTITION_LOADING"


def test_acks_never_precede_the_fsync_covering_them_and_keep_log_order(tmp_path):
    """Pipelined group commit: a group written while an fsync runs gets an fsync of its
    own (up to max_fsyncs_in_flight), but flushes end in the order they began, and the
    high watermark moves only when one ends."""
    gate = GatedFsync()
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=2, write_ahead_bytes=0)
    size = len(batch(7, 0))

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        second = start(owner, batch(7, 2))  # written while the first fsync runs
        await until(lambda: gate.calls == 2)
        third = start(owner, batch(7, 4))  # written; no fsync free: it waits for one
        await until(lambda: owner.log.log_end_offset == 6)
        await asyncio.sleep(0.05)
        assert gate.calls == 2 and gate.sizes == [size, 2 * size]
        assert not (first.done() or second.done() or third.done())
        assert owner.log.high_watermark == 0 and owner.read(0, 1 << 20)[0] == b""

        gate.release(1)  # the later fsync ends first: nobody is acknowledged yet
        await asyncio.sleep(0.05)
        assert not (first.done() or second.done()) and owner.log.high_watermark == 0

        gate.release(0)  # now both flushes end, in order
        assert [r.base_offset for r in await first] == [0]
        assert [r.base_offset for r in await second] == [2]
        assert owner.log.high_watermark == 4 and not third.done()
        await until(lambda: gate.calls == 3)  # began once a flush ended
        assert gate.sizes[2] == 3 * size
        gate.release(2)
        assert [r.base_offset for r in await third] == [4]
        assert owner.log.high_watermark == 6
        gate.release_all()
        await owner.close()

    asyncio.run(scenario())


def test_a_write_during_the_only_fsync_waits_for_the_next_one(tmp_path):
    gate = GatedFsync()
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=1, write_ahead_bytes=0)
    size = len(batch(7, 0))

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        retry = start(owner, batch(7, 0))  # a duplicate of a batch not durable yet
        await asyncio.sleep(0.02)  # decided on its own (in a group with new batches, it
        # would be answered with the flush covering them)
        later = [start(owner, batch(7, s)) for s in (2, 4)]
        await until(lambda: owner.log.log_end_offset == 6)  # written during the fsync
        await asyncio.sleep(0.02)
        assert gate.calls == 1 and not any(f.done() for f in [first, retry, *later])
        gate.release(0)
        await first
        duplicate = (await retry)[0]  # answered only once the original is durable
        assert (duplicate.base_offset, duplicate.duplicate) == (0, True)
        assert owner.log.high_watermark == 2 and not any(f.done() for f in later)
        await until(lambda: gate.calls == 2)
        assert gate.sizes[1] == 3 * size  # one fsync for both later groups
        gate.release(1)
        assert [(await f)[0].base_offset for f in later] == [2, 4]
        gate.release_all()
        await owner.close()

    asyncio.run(scenario())


def test_below_write_ahead_bytes_requests_wait_for_the_fsync_and_go_as_one_group(tmp_path):
    gate = GatedFsync()
    size = len(batch(7, 0))
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=1,
                             write_ahead_bytes=3 * size)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        waiting = [start(owner, batch(7, s)) for s in (2, 4)]
        await asyncio.sleep(0.05)
        assert owner.log.log_end_offset == 2  # 2 batches queued: below the threshold
        ahead = [start(owner, batch(7, s)) for s in (6, 8)]
        await until(lambda: owner.log.log_end_offset == 10)  # 4 queued: written ahead
        gate.release(0)
        await first
        await until(lambda: gate.calls == 2)
        assert gate.sizes[1] == 5 * size
        gate.release(1)
        assert [(await f)[0].base_offset for f in waiting + ahead] == [2, 4, 6, 8]
        gate.release_all()
        await owner.close()

    asyncio.run(scenario())


def test_a_failed_fsync_fails_every_batch_it_covered_and_the_partition_fails_closed(tmp_path):
    """The fsync of the second batch fails while the third's (begun after it) succeeds:
    neither is acknowledged, the log is cut back to what was durable, producer state is
    rebuilt from it, and a retry appends again at the same offsets."""
    gate = GatedFsync()
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=2)  # a free slot each

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        gate.release(0)
        assert [r.base_offset for r in await first] == [0]

        second = start(owner, batch(7, 2))
        await until(lambda: gate.calls == 2)
        third = start(owner, batch(7, 4))
        await until(lambda: gate.calls == 3)
        gate.release(2)
        await asyncio.sleep(0.05)
        assert not (second.done() or third.done())
        gate.release(1, OSError(errno.EIO, "Input/output error"))
        await fail_loading(second, third)

        await until(lambda: owner.state is State.ONLINE)
        assert owner.log.log_end_offset == owner.log.high_watermark == 2  # cut back
        assert [h.base_offset for h in owner.log.iter_headers()] == [0]
        gate.release_all()
        retried = await owner.produce([(batch(7, 2), parse_header(batch(7, 2)))])
        assert (retried[0].base_offset, retried[0].duplicate) == (2, False)
        await owner.close()

        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert [h.base_offset for h in again.log.iter_headers()] == [0, 2]
        await again.close()

    asyncio.run(scenario())


def test_snapshot_intervals_are_spread_around_their_settings(tmp_path):
    """Each interval's bounds are drawn at 75-125% of the settings, so partitions loaded
    together do not all drain and fsync their snapshots in the same instant."""
    owner = PartitionOwner("t", 0, tmp_path / "t-0", OwnerSettings(
        log=LogConfig(), snapshot_interval_batches=1_000, snapshot_interval_ms=5_000))
    drawn = set()
    for _ in range(50):
        owner._snapshot_taken()
        batches, ms = owner._snapshot_after
        assert 750 <= batches <= 1_250 and 3_750 <= ms <= 6_250
        drawn.add((batches, ms))
    assert len(drawn) > 10


def test_a_snapshot_being_written_holds_no_write_and_a_failed_one_fails_closed(tmp_path,
                                                                               monkeypatch):
    """The periodic snapshot's files are written on a worker thread while the owner goes
    on acknowledging writes (it used to wait for the write and its two fsyncs, holding
    every write of the partition); close() waits for it. A snapshot write that fails
    fails the partition closed, which reloads from disk (a full replay: no snapshot file
    was left) and serves again."""
    settings = OwnerSettings(log=LogConfig(), fsync=False, snapshot_interval_batches=4,
                             snapshot_interval_ms=3_600_000)
    snapshots = lambda: sorted((tmp_path / "t-0").glob("*.producer_snapshot"))  # noqa: E731
    monkeypatch.setattr("partition_server.owner.random.uniform", lambda low, high: 1.0)
    held, writing = threading.Event(), threading.Event()

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        write = owner._write_snapshots

        def held_write(*args):
            writing.set()
            held.wait(30)
            write(*args)

        owner._write_snapshots = held_write
        await produce(owner, [batch(7, s) for s in range(0, 8, 2)])  # due after 4 batches
        await until(writing.is_set)
        # Acknowledged while the snapshot write is held.
        await asyncio.wait_for(produce(owner, [batch(7, s) for s in range(8, 16, 2)]), 10)
        assert not snapshots()
        held.set()
        # The held one covers the first 4 batches; the next, due meanwhile, follows it.
        await until(lambda: [p.name[:20] for p in snapshots()] == [f"{8:020d}", f"{16:020d}"])

        def failing_write(*args):
            owner._write_snapshots = write  # fails once
            raise OSError(errno.EIO, "Input/output error")

        for path in snapshots():
            path.unlink()
        owner._write_snapshots = failing_write
        await produce(owner, [batch(7, s) for s in range(16, 24, 2)])  # the next one is due
        await until(lambda: owner._write_snapshots is write)
        await until(lambda: owner.state is State.ONLINE and owner.replayed_batches == 12)
        retried = await owner.produce([(batch(7, 24), parse_header(batch(7, 24)))])
        assert (retried[0].base_offset, retried[0].duplicate) == (24, False)
        await owner.close()
        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert [h.base_offset for h in again.log.iter_headers()] == list(range(0, 26, 2))
        await again.close()

    asyncio.run(scenario())


def test_a_roll_runs_off_the_event_loop_holding_only_its_partitions_writes(tmp_path):
    """A segment roll's disk work (the sealed segment's fsync, its index file, the next
    segment's file, the directory's fsync) runs on a worker thread through the owner's
    fsync: while it is held the event loop goes on, a flush begun before it ends and is
    answered, and a request that needs the new segment waits, written into it once the
    roll ends. The roll's two fsyncs through the owner are the sealed segment's, then the
    directory's."""
    gate = GatedFsync()
    size = len(batch(7, 0))
    settings = OwnerSettings(log=LogConfig(segment_bytes=2 * size), max_fsyncs_in_flight=2,
                             write_ahead_bytes=0)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        gate.release(0)
        await first
        second = start(owner, batch(7, 2))  # fills the segment; its fsync is held
        await until(lambda: gate.calls == 2)
        third = start(owner, batch(7, 4))  # needs a new segment: the roll begins
        await until(lambda: gate.calls == 3)
        sealed = tmp_path / "t-0" / f"{0:020d}.log"
        assert gate.sizes[2] == os.path.getsize(sealed) == 2 * size  # the sealed segment
        ticks = 0
        for _ in range(5):  # the loop runs while the roll's fsync is held
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 5 and owner.log.log_end_offset == 4 and not third.done()
        gate.release(1)  # the flush begun before the roll ends: answered during it
        assert [r.base_offset for r in await second] == [2]
        assert owner.log.segment_count == 1 and not third.done()
        gate.release(2)
        await until(lambda: gate.calls == 4)  # the directory's fsync, the new file made
        assert (tmp_path / "t-0" / f"{4:020d}.log").exists() and not third.done()
        assert owner.log.log_end_offset == 4
        gate.release(3)
        await until(lambda: gate.calls == 5)  # the roll ended: the third batch written
        assert owner.log.segment_count == 2 and owner.log.log_end_offset == 6
        assert (tmp_path / "t-0" / f"{0:020d}.index").exists()
        gate.release(4)
        assert [r.base_offset for r in await third] == [4]
        gate.release_all()
        await owner.close()
        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert [s.base_offset for s in again.log.segments()] == [0, 4]
        assert [h.base_offset for h in again.log.iter_headers()] == [0, 2, 4]
        await again.close()

    asyncio.run(scenario())


def test_a_failed_recovery_point_write_reloads_the_partition_with_no_write_after_it(
        tmp_path, monkeypatch):
    """The periodic recovery-point write runs on a worker thread. A full disk failing it
    breaks the log; the owner reloads the partition at once, though nothing is written to
    it again (an idle __txn_log partition stayed broken, its TC partition loading until
    the end of chaos seed 2791), and it serves reads and writes once the disk has room."""
    settings = OwnerSettings(log=LogConfig(recovery_point_interval_ms=0))
    full = threading.Event()
    real_write = log_module._atomic_write

    def atomic_write(*args, **kwargs):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(log_module, "_atomic_write", atomic_write)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await owner.start()
        await produce(owner, [batch(7, 0)])
        await until(lambda: not owner.log._recovery_point_deferred)
        broken = owner.log
        full.set()
        await produce(owner, [batch(7, 2)])  # acknowledged: its fsync succeeded
        await until(lambda: broken._broken is not None)
        full.clear()  # the disk has room again; nothing more is written
        await until(lambda: owner.log is not broken and owner.state is State.ONLINE)
        assert owner.log.high_watermark == 4
        assert [h.base_offset for h in owner.log.iter_headers()] == [0, 2]
        retried = await owner.produce([(batch(7, 4), parse_header(batch(7, 4)))])
        assert retried[0].base_offset == 4
        await owner.close()

    asyncio.run(scenario())


def test_a_failed_roll_fails_the_partition_closed_and_close_waits_for_a_roll(tmp_path):
    """The sealed segment's fsync fails in a roll: what it held unacknowledged fails, the
    partition reloads from what is durable and serves again, and a retry lands. Then a
    close while a roll's fsync is held waits for it; the reopened log is whole."""
    gate = GatedFsync()
    size = len(batch(7, 0))
    settings = OwnerSettings(log=LogConfig(segment_bytes=2 * size), max_fsyncs_in_flight=2,
                             write_ahead_bytes=0)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate)
        await owner.start()
        first = start(owner, batch(7, 0))
        await until(lambda: gate.calls == 1)
        gate.release(0)
        await first
        second = start(owner, batch(7, 2))
        await until(lambda: gate.calls == 2)
        third = start(owner, batch(7, 4))
        await until(lambda: gate.calls == 3)  # the roll's fsync of the sealed segment
        gate.release(2, OSError(errno.EIO, "Input/output error"))
        await fail_loading(second)  # written, never durable: not acknowledged
        gate.release(1)
        await until(lambda: owner.state is State.ONLINE)
        assert [h.base_offset for h in owner.log.iter_headers()] == [0]  # cut back
        gate.release_all()
        outcome = await asyncio.gather(third, return_exceptions=True)
        if isinstance(outcome[0], AtomlogError):  # failed with the rest, or written after
            assert outcome[0].reason == "PARTITION_LOADING"
        for sequence in (2, 4, 6):  # the segments [0, 4) and [4, 8)
            await owner.produce([(batch(7, sequence), parse_header(batch(7, sequence)))])
        assert [s.base_offset for s in owner.log.segments()] == [0, 4]

        with gate._lock:
            gate.open = False
        calls = gate.calls
        fifth = start(owner, batch(7, 8))  # needs a new segment: a roll, its fsync held
        await until(lambda: gate.calls == calls + 1 and owner._roll is not None)
        closing = asyncio.ensure_future(owner.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # waits for the roll's thread
        gate.release_all()
        await closing
        with pytest.raises(AtomlogError):
            await fifth  # never written: the owner stopped during the roll
        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert [s.base_offset for s in again.log.segments()] == [0, 4, 8]  # the roll's
        assert [h.base_offset for h in again.log.iter_headers()] == [0, 2, 4, 6]
        assert again.log.data_loss is None
        await again.close()

    asyncio.run(scenario())


def test_a_partition_whose_failed_open_does_not_close_cleanly_is_still_opened_again(
        tmp_path, monkeypatch):
    """The manager retries a partition's failed open; before each retry it closes the
    owner the failed attempt left LOADING. That close can fail too (its log's last fsync
    or recovery point, on the full disk that failed the open). Before, the failure ended
    the retry task: the partition stayed "assigned here, being opened" until some
    ZooKeeper change reconciled it. Now the next attempt runs all the same."""
    from types import SimpleNamespace

    from partition_server import manager as manager_module
    from partition_server.coordinator_epochs import CoordinatorEpochs
    from partition_server.manager import PartitionManager

    monkeypatch.setattr(manager_module, "OPEN_RETRY_FIRST_S", 0.01)
    key = ("t", 0)

    async def scenario():
        manager = PartitionManager(tmp_path, "server-1", None,
                                   OwnerSettings(log=LogConfig()),
                                   CoordinatorEpochs(None, tc_partitions=16))
        manager.assignments = SimpleNamespace(owned=lambda: {key})
        attempts, closes = [], []

        async def failing_close():
            closes.append(1)
            raise OSError(errno.ENOSPC, "No space left on device (test)")

        async def open_owner(topic, partition):
            attempts.append(1)
            if len(attempts) == 1:  # a LOADING owner left behind, as a failed load leaves
                manager.owners[key] = SimpleNamespace(state=State.LOADING,
                                                      close=failing_close)
                raise OSError(errno.ENOSPC, "No space left on device (test)")
            manager.owners[key] = SimpleNamespace(state=State.ONLINE)

        manager._open_owner = open_owner
        manager._opening.add(key)
        attempted = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(manager._open(*key, attempted), 10)
            assert attempts == [1, 1] and closes == [1]
            assert manager.owners[key].state is State.ONLINE
            assert key not in manager._opening
        finally:
            manager.owners.clear()  # stand-ins: nothing of theirs to close
            await manager.close()

    asyncio.run(scenario())


def test_a_closed_manager_s_partitions_are_no_longer_scraped(tmp_path):
    """A manager's metrics collectors are registered in the process's registry and were
    never unregistered: a closed manager's owners were still scraped, by every later
    scrape of that process. (A test's stand-in owner, scraped so by a later test in the
    same process, failed it.)"""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from partition_server.coordinator_epochs import CoordinatorEpochs
    from partition_server.manager import PartitionManager

    async def scenario():
        manager = PartitionManager(tmp_path, "server-1", None,
                                   OwnerSettings(log=LogConfig()),
                                   CoordinatorEpochs(None, tc_partitions=16))
        assert REGISTRY.get_sample_value("atomlog_partitions", {"state": "ONLINE"}) is not None
        await manager.close()
        manager.owners[("t", 0)] = SimpleNamespace(state=State.ONLINE)  # not scrapeable
        REGISTRY.get_sample_value("atomlog_partitions", {"state": "ONLINE"})  # raised

    asyncio.run(scenario())


def test_the_late_write_guard_is_sized_by_its_setting(tmp_path):
    """partition.late_write_guard_size reaches each owner's guard (it was 100,000 fixed:
    about 21 MB per partition, held while the partition is open)."""
    from partition_server.server import owner_settings
    from services.config import load_config

    where = {"server.data_dir": str(tmp_path)}
    default = owner_settings(load_config("partition_server", env={}, overrides=where))
    assert default.late_write_guard_size == 20_000
    config = load_config("partition_server", env={},
                         overrides={**where, "partition.late_write_guard_size": 5_000})
    owner = PartitionOwner("t", 0, tmp_path / "t-0", owner_settings(config))
    assert owner.guard.max_ended == 5_000


def test_append_times_answered_and_recorded_are_those_the_log_holds_after_a_clock_set_back(
        tmp_path):
    """The log never stamps an append time below its last one (found in its segments at
    open). The owner's clock began at the wall clock only: after a clock set back (or on
    a leader whose predecessor's clock was ahead), producer state recorded, and Produce
    answered, times earlier than those the log stored, so a replay recorded others."""
    from partition_server.log import PartitionLog

    ahead = int(time.time() * 1000) + 3_600_000
    with PartitionLog(tmp_path / "t-0", LogConfig(), clock_ms=lambda: ahead) as log:
        first = batch(7, 0)
        log.append([first])
        log.flush()

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", OwnerSettings(log=LogConfig()))
        await owner.start()
        try:
            second = batch(7, 2)
            [appended] = await owner.produce([(second, parse_header(second))])
            data, _, _ = owner.read(appended.base_offset, 1 << 20)
            stored = parse_header(data).log_append_time_ms
            assert appended.log_append_time_ms == stored >= ahead
            assert owner.producers.entry(7, stored).last_timestamp_ms == stored
        finally:
            await owner.close()

    asyncio.run(scenario())


def test_a_data_directory_belongs_to_the_server_name_that_first_started_on_it(tmp_path):
    """A server started under another name on a server's data directory (a host renamed,
    a container recreated without its fixed name, a volume swapped) took every replicated
    copy there for one a reassignment had removed, and deleted it at start: acknowledged
    records gone. The directory now records its server's name at the first start, and
    another name refuses to start (`cannot start`, INVALID_ARGUMENT) with nothing
    touched."""
    from partition_server.manager import SERVER_FILE, claim_data_directory

    copy = tmp_path / "orders-0"
    copy.mkdir()
    claim_data_directory(tmp_path, "ps-1")
    claim_data_directory(tmp_path, "ps-1")  # its own: fine, again and again
    with pytest.raises(AtomlogError) as refused:
        claim_data_directory(tmp_path, "partition-server-3f2a9c1b")
    assert refused.value.reason == "INVALID_ARGUMENT"
    assert "belongs to server 'ps-1'" in refused.value.message
    assert refused.value.metadata == {"field": "server.name", "recorded": "ps-1"}
    assert copy.is_dir()
    (tmp_path / SERVER_FILE).write_bytes(b"{garbage")
    with pytest.raises(AtomlogError, match="unreadable"):
        claim_data_directory(tmp_path, "ps-1")
