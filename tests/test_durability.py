"""The durability barrier (partition_server/durability.py): one round makes every log that
asked while the previous round ran durable with one syncfs per filesystem (or one fsync
per file, back to back); nothing is answered before the sync that began after it asked;
a failed syncfs fails every log of its filesystem, also one that asks only later; and
partition owners on the barrier acknowledge only after it, and fail closed with it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from partition_server import durability, uring
from partition_server.durability import (BarrierCore, DurabilityBarrier, Request, SyncTicket)
from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.record_batch import Record, encode_batch, parse_header
from services import failpoints
from services.errors import AtomlogError


# ---------------------------------------------------------------------------- core
def syncfs_request(device: int, epoch: int = 0) -> Request:
    return Request(SyncTicket(), loop=None, device=device, opened_epoch=epoch)


def test_a_round_takes_everything_that_waits_and_syncs_each_filesystem_once():
    core = BarrierCore()
    assert core.begin_round() is None
    first = [syncfs_request(1), syncfs_request(1), syncfs_request(2)]
    for request in first:
        core.submit(request)
    round_ = core.begin_round()
    assert round_.requests == first and round_.devices == [1, 2] and not round_.files
    late = syncfs_request(1)
    core.submit(late)
    assert core.begin_round() is None  # rounds never overlap: it waits for the next
    outcomes = core.end_round(round_, {}, {})
    assert [(request, error) for request, error in outcomes] == [(r, None) for r in first]
    second = core.begin_round()
    assert second.requests == [late] and second.devices == [1]


def test_a_failed_syncfs_fails_its_round_and_every_log_opened_before_it():
    core = BarrierCore()
    before = syncfs_request(1, epoch=core.error_epoch(1))
    other_fs = syncfs_request(2, epoch=core.error_epoch(2))
    core.submit(before)
    core.submit(other_fs)
    round_ = core.begin_round()
    failure = OSError(errno.EIO, "writeback failed")
    outcomes = dict((id(r), e) for r, e in core.end_round(round_, {1: failure}, {}))
    assert outcomes[id(before)] is failure and outcomes[id(other_fs)] is None
    # A log of that filesystem opened before the error asks later: syncfs no longer
    # reports the error, so the barrier must (its data may be what failed).
    stale = syncfs_request(1, epoch=0)
    fresh = syncfs_request(1, epoch=core.error_epoch(1))  # reopened after the error
    core.submit(stale)
    core.submit(fresh)
    outcomes = dict((id(r), e) for r, e in core.end_round(core.begin_round(), {}, {}))
    assert isinstance(outcomes[id(stale)], OSError) and outcomes[id(fresh)] is None


def test_a_failed_fsync_fails_only_its_own_file():
    core = BarrierCore()
    one = Request(SyncTicket(), None, fd=10, fsync=os.fsync)
    two = Request(SyncTicket(), None, fd=11, fsync=os.fsync)
    core.submit(one)
    core.submit(two)
    round_ = core.begin_round()
    assert round_.files == [one, two] and round_.devices == []
    failure = OSError(errno.EIO, "fsync failed")
    outcomes = dict((id(r), e) for r, e in core.end_round(round_, {}, {id(two): failure}))
    assert outcomes[id(one)] is None and outcomes[id(two)] is failure


# ---------------------------------------------------------------------------- shell
class GatedSync:
    """A syncfs (or fsync) that, while `hold` is set, waits until the test releases it;
    records the descriptors it was called with."""

    def __init__(self, real=None) -> None:
        self.calls: list[int] = []
        self.hold = False
        self.failures: list[OSError] = []  # raised by the next calls, in order
        self._released = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._real = real

    def __call__(self, fd: int) -> None:
        with self._lock:
            self.calls.append(fd)
            hold = self.hold
        if hold:
            assert self._released.acquire(timeout=10), "the test never released this sync"
        with self._lock:
            failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        if self._real is not None:
            self._real(fd)

    def release(self) -> None:
        self._released.release()


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_logs_that_ask_while_a_round_runs_share_the_next_syncfs(tmp_path):
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)
    directories = [tmp_path / f"p{i}" for i in range(4)]
    for directory in directories:
        directory.mkdir()

    async def scenario():
        syncs = [barrier.open(d, durability.SYNCFS) for d in directories]
        assert len(gate.calls) == 1  # the probe, once per filesystem
        assert all(s.mode == durability.SYNCFS for s in syncs)
        fd = os.open(directories[0] / "f", os.O_RDWR | os.O_CREAT)
        woken: list[int] = []
        gate.hold = True
        first = syncs[0].submit(fd, lambda: woken.append(0))
        await until(lambda: len(gate.calls) == 2)  # the first round runs
        later = [s.submit(fd, lambda i=i: woken.append(i)) for i, s in enumerate(syncs)]
        await asyncio.sleep(0.05)
        assert not first.done() and not any(t.done() for t in later)
        gate.release()
        await until(first.done)
        assert first.exception() is None and not any(t.done() for t in later)
        await until(lambda: len(gate.calls) == 3)  # one syncfs for the four of them
        gate.release()
        await until(lambda: all(t.done() for t in later))
        assert len(gate.calls) == 3 and barrier.rounds == 2 and barrier.syncs == 2
        assert all(t.exception() is None for t in later) and woken == [0, 0, 1, 2, 3]
        os.close(fd)

    asyncio.run(scenario())


def test_fsync_mode_fsyncs_the_files_of_a_round_at_once_on_duplicates(tmp_path):
    """A round's fsyncs run at the same time (each waits here until all three began),
    on duplicate descriptors the barrier closes; one that fails fails only its own log."""
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(3)]
    gate_fd = os.open(tmp_path / "gate", os.O_RDWR | os.O_CREAT)
    gate_inode, failing = os.fstat(gate_fd).st_ino, os.fstat(fds[1]).st_ino
    gate_entered, release_gate = threading.Event(), threading.Event()
    all_began = threading.Barrier(3, timeout=10)
    seen: list[int] = []

    def fsync(fd: int) -> None:
        inode = os.fstat(fd).st_ino
        if inode == gate_inode:  # its own round, held while the three are submitted
            gate_entered.set()
            assert release_gate.wait(10)
            return
        seen.append(fd)
        all_began.wait()  # breaks (and the test fails) unless the three run at once
        if inode == failing:
            raise OSError(errno.EIO, "bad")
        os.fsync(fd)

    barrier = DurabilityBarrier(syncfs=GatedSync(), fsync=fsync)

    async def scenario():
        sync = barrier.open(tmp_path, durability.FSYNC)
        assert sync.mode == durability.FSYNC
        first = sync.submit(gate_fd)
        # Only once the syncer holds the gate's round: else it could take the gate with
        # some of the three (its thread may run between two submits), and that round
        # would wait for the barrier forever while the rest queued behind it.
        await until(gate_entered.is_set, timeout_s=10)
        tickets = [sync.submit(fd) for fd in fds]
        release_gate.set()
        # Real fsyncs of three files: seconds when another process loads the disk (it
        # once took over 5 s while a benchmark ran beside the suite).
        await until(lambda: first.done() and all(t.done() for t in tickets), timeout_s=30)
        assert [t.exception() is None for t in tickets] == [True, False, True]
        assert barrier.rounds in (1, 2) and barrier.syncs == 4  # (the first may be alone)
        assert len(seen) == 3 and not set(seen) & set(fds)  # duplicates
        for duplicate in seen:  # closed after their round
            with pytest.raises(OSError):
                os.fstat(duplicate)

    asyncio.run(scenario())
    for fd in fds + [gate_fd]:
        os.close(fd)


def test_the_fsync_failpoint_fails_syncfs_too(tmp_path, monkeypatch):
    real = durability._load_syncfs()
    if real is None or not durability._kernel_reports_syncfs_errors():
        pytest.skip("no syncfs with error reporting here")
    barrier = DurabilityBarrier(syncfs=durability.failpoint_syncfs(real))

    async def scenario():
        sync = barrier.open(tmp_path, durability.SYNCFS)
        assert sync.mode == durability.SYNCFS
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        os.write(fd, b"x")
        await sync.sync(fd)  # a real syncfs
        points = tmp_path / "failpoints"
        points.mkdir()
        monkeypatch.setattr(failpoints, "_DIRECTORY", str(points))
        (points / failpoints.FSYNC).touch()
        with pytest.raises(OSError) as failed:
            await sync.sync(fd)
        assert failed.value.errno == errno.EIO
        os.close(fd)

    asyncio.run(scenario())


def test_the_fsync_slow_failpoint_delays_each_fsync_by_what_its_file_says(tmp_path,
                                                                        monkeypatch):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    points = tmp_path / "failpoints"
    points.mkdir()
    monkeypatch.setattr(failpoints, "_DIRECTORY", str(points))

    def timed() -> float:
        began = time.perf_counter()
        failpoints.fsync(fd)
        return time.perf_counter() - began

    assert timed() < 0.04  # not armed
    (points / failpoints.FSYNC_SLOW).write_text("60")
    assert timed() >= 0.06
    (points / failpoints.FSYNC_SLOW).write_text("")  # empty: the default
    assert timed() >= failpoints.FSYNC_SLOW_DEFAULT_MS / 1000
    (points / failpoints.FSYNC_SLOW).unlink()
    assert timed() < 0.04
    os.close(fd)


# ---------------------------------------------------------------------------- io_uring
def ring_or_skip() -> uring.Ring:
    ring = uring.Ring.open()
    if ring is None:
        pytest.skip("io_uring is refused here (kernel.io_uring_disabled or seccomp)")
    return ring


def test_a_ring_fsyncs_every_descriptor_and_answers_each_one_s_own_result(tmp_path):
    """Real fsyncs through io_uring, submitted without waiting, ENTRIES at a time (the
    most a caller may have in flight), with a pipe and a closed descriptor among them:
    fsync of a pipe fails EINVAL in the kernel and of a closed descriptor EBADF, so each
    answer is the kernel's fsync of that descriptor, not a blanket success; the
    registered eventfd says when completions are there."""
    ring = ring_or_skip()
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    ring.register_eventfd(efd)
    count = uring.ENTRIES * 2 + 5
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(count)]
    reader, writer = os.pipe()
    for fd in fds:
        os.write(fd, b"x" * 100)
    closed = os.open(tmp_path / "closed", os.O_RDWR | os.O_CREAT)
    os.close(closed)
    targets = fds[:70] + [writer, closed] + fds[70:]
    results: dict[int, int] = {}
    try:
        for start in range(0, len(targets), ring.entries):
            chunk = range(start, min(len(targets), start + ring.entries))
            for index in chunk:
                ring.queue_fsync(targets[index], index)
            results.update(ring.submit())
            while not all(index in results for index in chunk):
                select.select([efd], [], [], 10)
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(efd)
                results.update(ring.completions())
        assert sorted(results) == list(range(len(targets)))
        assert [results[70], results[71]] == [errno.EINVAL, errno.EBADF]
        assert all(results[i] == 0 for i in results if i not in (70, 71))
        assert ring.calls >= 3  # ENTRIES at a time
        assert ring.submit() == [] and ring.completions() == []
    finally:
        ring.close()
        for fd in fds + [reader, writer, efd]:
            os.close(fd)


def test_completions_on_the_kernel_s_overflow_list_are_flushed_and_read(tmp_path):
    """More fsyncs complete than the completion ring holds while nobody reads it: the
    kernel keeps the rest on its overflow list (IORING_SQ_CQ_OVERFLOW) until an
    io_uring_enter(GETEVENTS) flushes them. `completions` must flush and return every
    one; before, it read only what was in the ring, and a log whose fsync completion had
    overflowed waited for good (seen under load on kernel 6.18)."""
    ring = uring.Ring.open(entries=2)
    if ring is None:
        pytest.skip("io_uring is refused here (kernel.io_uring_disabled or seccomp)")
    assert ring.entries == 2  # and 4 completion entries
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(8)]

    def completed(count: int) -> bool:
        """The kernel has posted `count` completions (in the ring or on its list)."""
        info = Path(f"/proc/self/fdinfo/{ring._fd}").read_text()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        cq_tail, cq_head = int(fields["CqTail"]), int(fields["CqHead"])
        return (cq_tail - cq_head) + info.count("user_data=") >= count

    results: dict[int, int] = {}
    try:
        for start in range(0, 8, 2):  # 8 fsyncs, 2 in flight at a time, nothing read
            for index in (start, start + 1):
                os.write(fds[index], b"x")
                ring.queue_fsync(fds[index], index)
            # Submit as Ring.submit does, without its look at the completions after.
            uring._U32.pack_into(ring._sq, ring._sq_tail, ring._tail)
            assert ring._enter(2) == 2
            ring._queued = 0
            deadline = time.monotonic() + 10
            while not completed(start + 2) and time.monotonic() < deadline:
                time.sleep(0.01)
        overflowed = Path(f"/proc/self/fdinfo/{ring._fd}").read_text().count("user_data=")
        assert overflowed == 4  # 8 completed, 4 fit in the ring
        results.update(ring.completions())
        assert sorted(results) == list(range(8)) and set(results.values()) == {0}
        assert ring.flushes >= 1  # the overflow list was flushed, not left waiting
        assert ring.completions() == []
    finally:
        ring.close()
        for fd in fds:
            os.close(fd)


def ring_calls() -> float:
    return REGISTRY.get_sample_value("atomlog_durability_ring_calls_total")


def test_fsync_mode_goes_through_the_loop_s_ring_and_keeps_the_failpoints(tmp_path,
                                                                          monkeypatch):
    """The default fsync mode on an event loop: the fsyncs asked for in one loop turn are
    one non-blocking io_uring_enter and are answered on the loop (no syncer thread, no
    pool); their duplicates are closed; the fsync failpoint fails a turn's fsyncs with
    EIO and fsync_slow delays them without blocking the loop; a ring that fails fails
    what it holds closed and is replaced; a request from another thread, or after
    use_ring(False), goes to the syncer thread."""
    ring_or_skip().close()
    barrier = DurabilityBarrier()
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(4)]
    for fd in fds:
        os.write(fd, b"x" * 100)

    async def turn(sync) -> list[BaseException | None]:
        tickets = [sync.submit(fd) for fd in fds]  # one loop turn: one submission
        await until(lambda: all(t.done() for t in tickets), timeout_s=30)
        return [t.exception() for t in tickets]

    async def scenario():
        loop = asyncio.get_running_loop()
        sync = barrier.open(tmp_path, durability.FSYNC)
        calls = ring_calls()
        timed = REGISTRY.get_sample_value("atomlog_durability_round_seconds_count")
        assert await turn(sync) == [None] * 4
        assert ring_calls() == calls + 1
        # each fsync's time from submission to completion (the dashboard's disk panel)
        assert REGISTRY.get_sample_value("atomlog_durability_round_seconds_count") == timed + 4
        ring = barrier._loop_rings[loop]
        assert barrier._thread is None and barrier._pool is None
        open_before = len(os.listdir("/proc/self/fd"))  # the ring's and its eventfd
        assert await turn(sync) == [None] * 4
        assert len(os.listdir("/proc/self/fd")) == open_before  # duplicates closed
        points = tmp_path / "failpoints"
        points.mkdir()
        monkeypatch.setattr(failpoints, "_DIRECTORY", str(points))
        (points / failpoints.FSYNC).touch()
        calls = ring_calls()
        errors = await turn(sync)
        assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors)
        assert ring_calls() == calls  # nothing submitted
        (points / failpoints.FSYNC).unlink()
        (points / failpoints.FSYNC_SLOW).write_text("1000")
        began = time.monotonic()
        tickets = [sync.submit(fd) for fd in fds]
        # The loop runs meanwhile: this sleep ends long before the slow disk's second
        # (a sleep on the loop would hold it for the whole second).
        await asyncio.sleep(0.15)
        assert time.monotonic() - began < 0.9 and not any(t.done() for t in tickets)
        await until(lambda: all(t.done() for t in tickets), timeout_s=30)
        assert time.monotonic() - began >= 1.0 and all(t.exception() is None for t in tickets)
        (points / failpoints.FSYNC_SLOW).unlink()
        # The ring itself failing (io_uring_enter refused: ENOMEM, here injected): every
        # fsync it holds fails closed, and the next request gets a new ring.
        ring._ring._enter = lambda to_submit: -errno.ENOMEM
        errors = await turn(sync)
        assert all(isinstance(e, OSError) and e.errno == errno.ENOMEM for e in errors)
        assert ring.closed
        calls = ring_calls()
        assert await turn(sync) == [None] * 4
        assert barrier._loop_rings[loop] is not ring and ring_calls() == calls + 1
        assert len(os.listdir("/proc/self/fd")) == open_before  # the old ring's closed
        # From another thread: the syncer thread's round, answered on the loop.
        ticket = await loop.run_in_executor(None, sync.submit, fds[0])
        await until(ticket.done, timeout_s=30)
        assert ticket.exception() is None and barrier._thread is not None
        barrier.use_ring(False)
        calls = ring_calls()
        assert await turn(sync) == [None] * 4
        assert ring_calls() == calls  # on the thread again
        barrier.use_ring(True)
        return loop

    first = asyncio.run(scenario())
    assert not barrier._loop_rings[first].closed  # the loop closed; its ring is freed ...

    async def next_loop():
        assert await turn(barrier.open(tmp_path, durability.FSYNC)) == [None] * 4

    asyncio.run(next_loop())
    assert first not in barrier._loop_rings  # ... when the next loop takes a ring
    for fd in fds:
        os.close(fd)


def test_where_io_uring_is_refused_fsync_rounds_stay_on_threads(tmp_path, monkeypatch):
    """A kernel or seccomp profile that refuses io_uring_setup (Ring.open() is None, as
    under Docker's default profile): the round's fsyncs run on the thread pool, and the
    barrier does not ask the kernel again for every round."""
    opened = []
    monkeypatch.setattr(uring.Ring, "open", classmethod(lambda cls: opened.append(1)))
    barrier = DurabilityBarrier()
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(3)]
    gate_fd = os.open(tmp_path / "gate", os.O_RDWR | os.O_CREAT)

    async def scenario():
        sync = barrier.open(tmp_path, durability.FSYNC)
        await sync.sync(gate_fd)
        for _ in range(3):
            tickets = [sync.submit(fd) for fd in fds]
            await until(lambda: all(t.done() for t in tickets), timeout_s=30)
            assert [t.exception() for t in tickets] == [None] * 3
        assert barrier._loop_rings == {} and barrier._pool is not None
        assert len(opened) == 1

    asyncio.run(scenario())
    for fd in fds + [gate_fd]:
        os.close(fd)


# ---------------------------------------------------------------------------- owners
def batch(producer_id: int, sequence: int) -> bytes:
    return encode_batch([Record(b"k", b"v" * 50)] * 2, producer_id=producer_id,
                        producer_epoch=0, base_sequence=sequence, timestamp_ms=1_000)


def start(owner: PartitionOwner, b: bytes) -> asyncio.Future:
    return asyncio.ensure_future(owner.produce([(b, parse_header(b))]))


SETTINGS = OwnerSettings(log=LogConfig(), durability=durability.SYNCFS)


def test_owners_acknowledge_only_after_the_shared_syncfs_that_began_after_their_write(tmp_path):
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owners = [PartitionOwner("t", i, tmp_path / f"t-{i}", SETTINGS, barrier=barrier)
                  for i in range(3)]
        for owner in owners:
            await owner.start()
        probes = len(gate.calls)
        gate.hold = True
        first = start(owners[0], batch(7, 0))
        await until(lambda: len(gate.calls) == probes + 1)
        others = [start(owner, batch(7, 0)) for owner in owners[1:]]  # during the round
        await until(lambda: all(o.log.log_end_offset == 2 for o in owners))
        await asyncio.sleep(0.05)
        assert not first.done() and not any(f.done() for f in others)
        assert [o.log.high_watermark for o in owners] == [0, 0, 0]
        gate.release()
        assert [r.base_offset for r in await first] == [0]
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in others)
        assert [o.log.high_watermark for o in owners] == [2, 0, 0]
        await until(lambda: len(gate.calls) == probes + 2)  # one syncfs for both
        gate.release()
        results = [(await f)[0] for f in others]
        assert [r.base_offset for r in results] == [0, 0]
        assert [o.log.high_watermark for o in owners] == [2, 2, 2]
        assert len(gate.calls) == probes + 2
        gate.hold = False
        for owner in owners:
            await owner.close()

    asyncio.run(scenario())


async def parked_on_a_held_flush(owner: PartitionOwner, gate: "GatedSync",
                                 b: bytes) -> asyncio.Future:
    """Produce `b` with the barrier's round held: the future of its request, once its
    flush is in the round and the owner task is parked (idle) meanwhile."""
    gate.hold = True
    probes = len(gate.calls)
    future = start(owner, b)
    await until(lambda: len(gate.calls) == probes + 1)
    await until(lambda: owner._wake is not None and not owner._wake.done())
    return future


def refuse_to_end(*_args, **_kwargs):
    """A log's flush_end that fails, as when its recovery point cannot be written."""
    raise OSError(errno.EIO, "the recovery point could not be written")


def test_an_idle_owner_s_flush_is_settled_in_the_barrier_s_answer_without_waking_it(tmp_path):
    """The owner task is parked while its only flush is in a round: the barrier's answer
    settles the flush itself (the request is acknowledged, the high watermark moves) and
    does not wake the task. With a request queued meanwhile, the answer wakes the task,
    which settles and writes in one step."""
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", SETTINGS, barrier=barrier)
        await owner.start()
        pokes = []
        poke = owner._poke
        owner._poke = lambda *args: (pokes.append(len(gate.calls)), poke(*args))
        probes = len(gate.calls)
        first = await parked_on_a_held_flush(owner, gate, batch(7, 0))
        woken = len(pokes)
        gate.release()
        assert [r.base_offset for r in await first] == [0]
        assert owner.log.high_watermark == 2
        assert len(pokes) == woken  # settled in the answer: the task was not woken

        second = start(owner, batch(7, 2))
        await until(lambda: len(gate.calls) == probes + 2)
        third = start(owner, batch(7, 4))  # queued behind the flush in flight
        await until(lambda: len(owner._queue) == 1)
        woken = len(pokes)
        gate.release()
        assert [r.base_offset for r in await second] == [2]
        assert len(pokes) == woken + 1  # the task settles it and writes the third
        await until(lambda: len(gate.calls) == probes + 3)
        gate.release()
        assert [r.base_offset for r in await third] == [4]
        gate.hold = False
        await owner.close()

    asyncio.run(scenario())


def test_a_flush_the_log_cannot_end_in_the_barrier_s_answer_fails_closed(tmp_path):
    """Ending a flush fails while the barrier's answer settles it (here the log refuses
    it, as it would a write of its recovery point that failed): the failure is the owner
    task's, as if the task had settled it: the request fails PARTITION_LOADING instead of
    waiting for ever, the partition reloads from what is durable, and a retry appends."""
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", SETTINGS, barrier=barrier)
        await owner.start()
        assert [r.base_offset for r in await start(owner, batch(7, 0))] == [0]
        second = await parked_on_a_held_flush(owner, gate, batch(7, 2))
        broken = owner.log
        broken.flush_end = refuse_to_end  # this log object only: the reload opens a new one
        gate.release()
        with pytest.raises(AtomlogError) as refused:
            await asyncio.wait_for(second, 10)
        assert refused.value.reason == "PARTITION_LOADING"
        gate.hold = False
        await until(lambda: owner.state is State.ONLINE and owner.log is not broken)
        assert owner.log.high_watermark == 2
        retried = await start(owner, batch(7, 2))
        assert (retried[0].base_offset, retried[0].duplicate) == (2, False)
        await owner.close()

    asyncio.run(scenario())


def test_a_close_between_a_failed_settle_and_the_owner_task_still_answers_its_requests(
        tmp_path):
    """As above, but the owner is closed before its task takes the failure up: the
    requests of the flush that could not end fail SHUTTING_DOWN, not waiting for ever."""
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", SETTINGS, barrier=barrier)
        await owner.start()
        first = await parked_on_a_held_flush(owner, gate, batch(7, 0))
        owner.log.flush_end = refuse_to_end
        poke = owner._poke
        # The failure's wake-up of the task comes after a close's cancel instead.
        owner._poke = lambda *args: (owner._task.cancel(), poke(*args))
        gate.release()
        with pytest.raises(AtomlogError) as refused:
            await asyncio.wait_for(first, 10)
        assert refused.value.reason == "SHUTTING_DOWN"
        gate.hold = False
        owner._poke = poke
        await owner.close()

    asyncio.run(scenario())


def test_the_oldest_fsync_in_flight_is_a_gauge_that_grows_until_it_ends(tmp_path):
    """`atomlog_partition_oldest_fsync_seconds` (partition_server/metrics.py, read at
    scrape time on another thread): the age of the oldest group-commit fsync in flight.
    A sync that does not end shows only there (AtomlogFsyncStuck; the fsync histogram
    times those that end); 0 once it ends."""
    from partition_server.metrics import PartitionStateCollector

    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    def oldest(owners) -> float:
        families = PartitionStateCollector(lambda: owners).collect()
        family = next(f for f in families if f.name == "atomlog_partition_oldest_fsync_seconds")
        return family.samples[0].value

    async def scenario():
        owners = [PartitionOwner("t", i, tmp_path / f"t-{i}", SETTINGS, barrier=barrier)
                  for i in range(2)]
        for owner in owners:
            await owner.start()
        assert oldest(owners) == 0.0
        probes = len(gate.calls)
        gate.hold = True
        held = start(owners[0], batch(7, 0))
        await until(lambda: len(gate.calls) == probes + 1)
        await asyncio.sleep(0.3)
        first = await asyncio.to_thread(oldest, owners)  # as the metrics thread reads it
        await asyncio.sleep(0.2)
        assert 0.3 <= first < oldest(owners) < 10 and not held.done()
        gate.release()
        await held
        assert oldest(owners) == 0.0
        gate.hold = False
        for owner in owners:
            await owner.close()

    asyncio.run(scenario())


def test_a_failed_syncfs_fails_closed_every_owner_of_the_filesystem(tmp_path):
    """Owner 0's syncfs fails. Owner 1 wrote before the failure but asks only after it:
    the next syncfs no longer reports the error, yet owner 1 is refused too, reloads
    from its durable log and acknowledges nothing that was not durable."""
    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owners = [PartitionOwner("t", i, tmp_path / f"t-{i}", SETTINGS, barrier=barrier)
                  for i in range(2)]
        for owner in owners:
            await owner.start()
        for owner in owners:
            assert [r.base_offset for r in await start(owner, batch(7, 0))] == [0]
        gate.hold = True
        probes = len(gate.calls)
        first = start(owners[0], batch(7, 2))
        await until(lambda: len(gate.calls) == probes + 1)
        # Owner 1 writes now; its flush waits for the next round (as if its data's
        # writeback were what failed in this one).
        second = start(owners[1], batch(7, 2))
        await until(lambda: owners[1].log.log_end_offset == 4)
        gate.failures.append(OSError(errno.EIO, "writeback error"))
        gate.release()
        with pytest.raises(AtomlogError) as refused:
            await first
        assert refused.value.reason == "PARTITION_LOADING"
        await until(lambda: len(gate.calls) == probes + 2)
        gate.release()  # this syncfs succeeds: the error was reported once, above
        with pytest.raises(AtomlogError) as refused:
            await second
        assert refused.value.reason == "PARTITION_LOADING"
        gate.hold = False
        for owner in owners:
            await until(lambda: owner.state is State.ONLINE)
            assert owner.log.log_end_offset == owner.log.high_watermark == 2  # cut back
        for owner in owners:  # serving again, on a fresh view of the filesystem
            retried = await start(owner, batch(7, 2))
            assert (retried[0].base_offset, retried[0].duplicate) == (2, False)
            await owner.close()

    asyncio.run(scenario())


def _mode_used(mode: str, directory: Path) -> str:
    """The round a barrier opened in `mode` makes for a log in `directory`: auto's choice
    by filesystem, and fsync where syncfs (without error reporting) is not to be had."""
    used = durability.barrier_mode(mode, os.stat(directory).st_dev, os.stat("/").st_dev)
    if used == durability.SYNCFS and (durability._load_syncfs() is None or
                                      not durability._kernel_reports_syncfs_errors()):
        return durability.FSYNC  # the fallback
    return used


@pytest.mark.parametrize("mode", [durability.AUTO, durability.FSYNC, durability.SYNCFS])
def test_owners_on_the_process_barrier_end_to_end(tmp_path, mode):
    """The default (fsync), auto and syncfs with the process's barrier and the kernel's
    calls: acknowledged, durable, and read back after a reopen."""
    assert OwnerSettings(log=LogConfig()).durability == durability.FSYNC
    settings = OwnerSettings(log=LogConfig(), durability=mode)

    async def scenario():
        owners = [PartitionOwner("t", i, tmp_path / f"t-{i}", settings) for i in range(4)]
        for owner in owners:
            await owner.start()
        before = durability.barrier().syncs
        results = await asyncio.gather(*[start(o, batch(7, 0)) for o in owners])
        assert all(r[0].base_offset == 0 for r in results)
        syncs = durability.barrier().syncs - before
        assert 1 <= syncs <= 4
        assert owners[0]._log_sync.mode == _mode_used(mode, tmp_path)
        for owner in owners:
            await owner.close()
        again = PartitionOwner("t", 0, tmp_path / "t-0", settings)
        await again.start()
        assert again.log.high_watermark == 2
        await again.close()

    asyncio.run(scenario())


def test_auto_is_syncfs_off_the_root_filesystem_and_fsync_on_it():
    assert durability.barrier_mode(durability.AUTO, device=7, root_device=7) == durability.FSYNC
    assert durability.barrier_mode(durability.AUTO, device=8, root_device=7) == durability.SYNCFS
    for mode in (durability.FSYNC, durability.SYNCFS):  # set by the operator: kept
        assert durability.barrier_mode(mode, device=8, root_device=7) == mode
        assert durability.barrier_mode(mode, device=7, root_device=7) == mode


def test_an_auto_barrier_fsyncs_logs_on_the_root_filesystem_and_syncfs_elsewhere(tmp_path):
    """The real barrier, real directories: one on `/`'s filesystem (tmp_path here, when
    it is there) and one on a tmpfs (/dev/shm), each opened in auto mode."""
    root = os.stat("/").st_dev
    if os.stat(tmp_path).st_dev != root:
        pytest.skip("the test's temporary directory is not on the root filesystem")
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == root:
        pytest.skip("no /dev/shm on a filesystem of its own")
    if durability._load_syncfs() is None or not durability._kernel_reports_syncfs_errors():
        pytest.skip("no syncfs with error reporting here")
    barrier = DurabilityBarrier()
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    try:
        async def scenario():
            on_root = barrier.open(tmp_path, durability.AUTO)
            off_root = barrier.open(elsewhere, durability.AUTO)
            assert on_root.mode == durability.FSYNC
            assert off_root.mode == durability.SYNCFS
            for directory, sync in ((tmp_path, on_root), (elsewhere, off_root)):
                fd = os.open(directory / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                try:
                    os.write(fd, b"x" * 100)
                    await sync.sync(fd)  # durable, through the mode's round
                finally:
                    os.close(fd)
            assert barrier.syncs == 2  # one fsync, one syncfs

        asyncio.run(scenario())
    finally:
        shutil.rmtree(elsewhere)


def test_a_subscription_journal_whose_reopen_fails_too_is_reopened_later(
        tmp_path, monkeypatch):
    """A failed round breaks the journal, and its reopen from the disk fails too (ENOSPC
    creating the new journal, as on the full disk that broke it). Before, nothing tried
    again: the partition's subscriptions answered PARTITION_LOADING until the owner
    reloaded. Now the reopen is tried again in the background until it opens."""
    from partition_server import subscriptions as subscriptions_module
    settings = OwnerSettings(log=LogConfig(), durability=durability.FSYNC)
    barrier = DurabilityBarrier()
    monkeypatch.setattr(subscriptions_module, "REOPEN_RETRY_S", 0.05)
    real_open = subscriptions_module.CursorStore.open
    refusals = []

    def open_refusing_twice(*args, **kwargs):
        if len(refusals) < 2:
            refusals.append(1)
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return real_open(*args, **kwargs)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, barrier=barrier)
        await owner.start()
        subscriptions = owner.subscriptions
        await start(owner, batch(7, 0))
        assert await subscriptions.create("s", 0) == (True, 0)
        points = tmp_path / "failpoints"
        points.mkdir()
        monkeypatch.setattr(failpoints, "_DIRECTORY", str(points))
        monkeypatch.setattr(subscriptions_module.CursorStore, "open",
                            staticmethod(open_refusing_twice))
        (points / failpoints.FSYNC).touch()
        with pytest.raises(AtomlogError) as refused:
            await subscriptions.ack("s", 1, (), None, owner.max_read_position())
        assert refused.value.reason == "PARTITION_LOADING"
        (points / failpoints.FSYNC).unlink()
        await until(lambda: len(refusals) == 2)  # the reopen failed, and once more
        assert subscriptions.store is None
        await until(lambda: subscriptions.store is not None)  # the third try opened
        assert await subscriptions.ack("s", 1, (), None, owner.max_read_position()) == 1
        await owner.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", [durability.FSYNC, durability.SYNCFS])
def test_a_subscription_journal_is_made_durable_in_the_barrier_round_and_fails_closed(
        tmp_path, monkeypatch, mode):
    """A partition's subscription journal (the cursor store) asks the owner's barrier,
    in the owner's mode, instead of fsyncing on a worker thread of its own; a failed
    round (the fsync failpoint, which fails syncfs too) breaks the store, whose change
    is refused and which reopens from what is durable."""
    settings = OwnerSettings(log=LogConfig(), durability=mode)
    barrier = DurabilityBarrier()

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, barrier=barrier)
        await owner.start()
        subscriptions = owner.subscriptions
        assert subscriptions._log_sync is not None
        assert subscriptions._log_sync.mode == _mode_used(mode, tmp_path)
        await start(owner, batch(7, 0))
        before = barrier.rounds
        assert await subscriptions.create("s", 0) == (True, 0)
        assert barrier.rounds > before  # durable through the barrier
        assert await subscriptions.ack("s", 1, (), None, owner.max_read_position()) == 1
        points = tmp_path / "failpoints"
        points.mkdir()
        monkeypatch.setattr(failpoints, "_DIRECTORY", str(points))
        (points / failpoints.FSYNC).touch()
        with pytest.raises(AtomlogError) as refused:
            await subscriptions.ack("s", 2, (), None, owner.max_read_position())
        assert refused.value.reason == "PARTITION_LOADING"
        (points / failpoints.FSYNC).unlink()
        await until(lambda: subscriptions.store is not None)  # reopened from the disk
        # The refused ack was written before its round failed: read back from the file,
        # it may be there (a refused change is not acknowledged, not undone). Its retry
        # is answered once durable.
        assert subscriptions.cumulative_end("s") in (1, 2)
        assert await subscriptions.ack("s", 2, (), None, owner.max_read_position()) == 2
        await owner.close()

    asyncio.run(scenario())


def test_every_directory_a_server_creates_is_made_durable_in_its_parent(tmp_path,
                                                                       monkeypatch):
    """A new directory's entry is metadata of its parent, which a power cut may lose on
    file systems without ordered metadata, and with it every file inside: a partition's
    directory and its cursors' directory, the write-ahead file's, the data directory.
    They were made with mkdir alone (an audit's finding); now each one created is
    followed by an fsync of its parent."""
    from partition_server import snapshot_files
    from partition_server.cursor_store import CursorStore
    from partition_server.log import PartitionLog

    synced: list[Path] = []
    real = snapshot_files.fsync_directory

    def recording(directory):
        synced.append(Path(directory))
        real(directory)

    monkeypatch.setattr(snapshot_files, "fsync_directory", recording)
    snapshot_files.make_directory(tmp_path / "a" / "b")
    assert synced == [tmp_path, tmp_path / "a"]
    snapshot_files.make_directory(tmp_path / "a" / "b")  # there already: nothing to sync
    assert len(synced) == 2
    partition_log = PartitionLog(tmp_path / "data" / "t-0", LogConfig())
    partition_log.close()
    assert {tmp_path, tmp_path / "data"} <= set(synced)
    CursorStore.open(tmp_path / "data" / "t-0" / "cursors").close()
    assert tmp_path / "data" / "t-0" in synced
