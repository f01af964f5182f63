"""One durability barrier per process: group commit across partitions.

Each partition owner group-commits its own log (partition_server/owner.py). Without
this module every owner's flush is its own fsync on an executor thread, so a small
transaction over 4 partitions plus the TC log costs 5 or more fsyncs, each a thread
hand-off, a `concurrent.futures.Future`, an `os.dup` and a wake-up of the event loop.
The barrier makes all of them one step: owners that need durability submit "this log,
as written now" and wait; one syncer thread takes everything submitted while its
previous round ran and makes it durable in one round; the round's results go back to
each event loop in one `call_soon_threadsafe`.

A round is, per `partition.durability`:
- `fsync` (the default): the round fsyncs each submitted log's file, all at once on up
  to FSYNC_THREADS threads (ext4 commits concurrent fsyncs in one journal commit), each
  on a duplicate of the log's descriptor that the barrier closes (the log may close its
  own meanwhile: a roll, a reopen). The same fsyncs as each owner's own on an executor
  thread, without a `concurrent.futures.Future`, a future callback and a wake-up of the
  event loop per fsync; and owners that ask together are answered together. Where the
  kernel allows it (`partition.fsync_ring`, on by default) fsync mode skips the syncer
  thread altogether: each event loop has an io_uring of its own (`LoopRing` below, on
  partition_server/uring.py's Ring), the fsyncs asked for in one loop turn are one
  non-blocking io_uring_enter that the kernel runs at once on its own workers, and the
  loop reads their completions from an eventfd, so no thread takes the GIL for them
  (docs/benchmarks.md). A process where io_uring is refused keeps the thread and its
  pool.
- `syncfs`: one syncfs(2) per filesystem holding a submitting log, on a descriptor the
  barrier keeps open for that filesystem. syncfs writes back and waits for every dirty
  file of the filesystem and flushes the device cache as fsync does (man 2 sync: it
  gives "the same guarantees as fsync called on every file in ... the filesystem").
  Since Linux 5.8 it also reports writeback errors of any file of the filesystem that
  happened since the descriptor last looked (the superblock's errseq, commit
  735e4ae5ba28 "vfs: track per-sb writeback errors and report them to syncfs").
  Because the error is not tied to a file, a failed syncfs fails every log of that
  filesystem, not only the logs of the round: each log carries the filesystem's error
  count from when it was opened, and a round answers a log opened before the latest
  error with that error, so its owner fails closed and reopens from disk before
  acknowledging anything (a log that wrote before the error and asks for durability
  only later would otherwise be told its data is durable by a syncfs that no longer
  sees the error). Without syncfs (not Linux, a kernel before 5.8, or the call fails
  with ENOSYS/EINVAL) the barrier falls back to `fsync`. It writes back every dirty
  file of the filesystem, other processes' too, so its time follows everything written
  there: measured on a shared disk it used the least CPU and had the longest commits
  (docs/benchmarks.md); it is for a data filesystem of the server's own.
- `auto`: `syncfs` for a log on a filesystem other than the one holding `/` (a volume
  mounted for data: a Kubernetes persistent volume, a disk of its own), `fsync` for a
  log on the root filesystem, which the operating system and every other program write
  to. Measured on this machine (docs/benchmarks.md, "`auto` durability"), syncfs used
  about a fifth less server CPU per small transaction than the fsync round, on a
  loop-mounted ext4 of its own and on the shared root alike, but consume-transform-
  produce (100 KiB per transaction) ran 5-20% slower with it, and on the root it had the
  longest commits whenever other programs wrote heavily there. So `fsync` stays the
  default; `auto` is for many small transactions on a volume of their own.

The fault harness's fsync failpoint (services/failpoints.py) fails both kinds of round;
its fsync_slow failpoint slows both (benchmarks of a slow disk).
The pure core (`BarrierCore`: no I/O, no threads, no clock) decides what a round does
and whom it answers with what; `DurabilityBarrier` is the shell (the thread, the
syscalls, the hand-back to event loops).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from partition_server import uring
from services import failpoints
from services.fastmetrics import Counter, Histogram
from services.metrics import LATENCY_BUCKETS_SECONDS

log = logging.getLogger(__name__)

ROUNDS = Counter("atomlog_durability_rounds_total",
                 "Rounds of the durability barrier (each answers every log that asked "
                 "while the previous one ran; with an event loop's io_uring, each "
                 "submission of a loop turn's fsyncs).")
SYNCS = Counter("atomlog_durability_syncs_total",
                "syncfs or fsync calls the durability barrier made.", ["kind"])
REQUESTS = Counter("atomlog_durability_requests_total",
                   "Group commits the durability barrier answered.")
WAIT_SECONDS = Histogram("atomlog_durability_wait_seconds",
                         "From a log's request to the start of the round that syncs it (a "
                         "round in flight is waited for).", buckets=LATENCY_BUCKETS_SECONDS)
RING_CALLS = Counter("atomlog_durability_ring_calls_total",
                     "io_uring_enter system calls of fsync mode (partition.fsync_ring): each "
                     "submits the fsyncs an event loop asked for in one turn, or flushes "
                     "completions off the kernel's overflow list.")
RING_FLUSHES = Counter("atomlog_durability_ring_flushes_total",
                       "io_uring_enter calls that flushed fsync completions the kernel had "
                       "put on its overflow list (partition_server/uring.py) into the ring.")
# While fsyncs are in flight on an event loop's ring, it looks at the completions this often
# even if its eventfd did not ring (LoopRing._look_again).
WATCH_S = 0.5
ROUND_SECONDS = Histogram("atomlog_durability_round_seconds",
                          "The syscalls of one round (its fsyncs at once, or its syncfs "
                          "calls; through an event loop's io_uring, each fsync from its "
                          "submission to its completion).", buckets=LATENCY_BUCKETS_SECONDS)

SYNCFS = "syncfs"
FSYNC = "fsync"  # per file, batched on the barrier's thread
EXECUTOR = "executor"  # per file, each owner's own fsync on the default executor
AUTO = "auto"  # syncfs off the root filesystem, fsync on it
WAL = "wal"  # one write-ahead file per server (partition_server/wal.py)
MODES = (AUTO, SYNCFS, FSYNC, EXECUTOR, WAL)
FSYNC_THREADS = 8  # fsync mode: fsyncs of one round run at once on up to this many


_SYNCFS_CALLS = SYNCS.labels("syncfs")
_FSYNC_CALLS = SYNCS.labels("fsync")


# ---------------------------------------------------------------------------- core
def barrier_mode(mode: str, device: int, root_device: int) -> str:
    """The barrier's mode for a log whose directory is on filesystem `device` (st_dev),
    `root_device` being that of `/`: `auto` is syncfs off the root filesystem, fsync on
    it; syncfs and fsync stay."""
    if mode == AUTO:
        return SYNCFS if device != root_device else FSYNC
    return mode


class SyncTicket:
    """One owner's request for durability: done() once its round ended; exception()
    then says whether it failed (the asyncio.Future API the owner reads)."""

    __slots__ = ("_done", "_error", "wake")

    def __init__(self, wake: Callable[[], object] | None = None):
        self._done = False
        self._error: BaseException | None = None
        self.wake = wake  # called on the owner's event loop once the ticket is done

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        assert self._done, "the ticket's round has not ended"
        return self._error

    def finish(self, error: BaseException | None) -> None:
        self._done, self._error = True, error


@dataclass(slots=True)
class Request:
    ticket: SyncTicket
    loop: object  # the event loop to answer on (opaque to the core)
    device: int | None = None  # syncfs: the filesystem (st_dev)
    opened_epoch: int = 0  # syncfs: the filesystem's error count when the log opened
    fd: int | None = None  # fsync: a duplicate descriptor, closed after the round
    fsync: Callable[[int], None] | None = None
    submitted: float = 0.0  # time.perf_counter() of the request (the wait metric)


@dataclass
class Round:
    requests: list[Request]
    devices: list[int]  # syncfs once on each
    files: list[Request] = field(default_factory=list)  # fsync each


class BarrierCore:
    """What the next round syncs and what each request is answered. Not thread-safe:
    the shell holds its lock around every call."""

    def __init__(self) -> None:
        self._pending: list[Request] = []
        self.running = False
        self._errors: dict[int, int] = {}  # device -> failed syncfs rounds on it

    def error_epoch(self, device: int) -> int:
        return self._errors.get(device, 0)

    def submit(self, request: Request) -> None:
        self._pending.append(request)

    def begin_round(self) -> Round | None:
        """Everything submitted since the last round began, as one round (None when
        nothing waits or a round runs: rounds never overlap)."""
        if self.running or not self._pending:
            return None
        requests, self._pending = self._pending, []
        self.running = True
        devices: list[int] = []
        files: list[Request] = []
        for request in requests:
            if request.fd is not None:
                files.append(request)
            elif request.device not in devices:
                devices.append(request.device)
        return Round(requests, devices, files)

    def end_round(self, round_: Round, device_errors: dict[int, BaseException],
                  file_errors: dict[int, BaseException]) -> list[tuple[Request, BaseException | None]]:
        """The round's syncs ended with these errors (by device; by id() of the file
        request). Returns each request with its outcome."""
        self.running = False
        for device in device_errors:
            self._errors[device] = self._errors.get(device, 0) + 1
        outcomes = []
        for request in round_.requests:
            if request.fd is not None:
                error = file_errors.get(id(request))
            else:
                error = device_errors.get(request.device)
                if error is None and self._errors.get(request.device, 0) > request.opened_epoch:
                    error = OSError(errno.EIO, "a sync of this filesystem failed since the "
                                    "log was opened (syncfs reports a writeback error once, "
                                    "for every file): reopen the log from disk")
            outcomes.append((request, error))
        return outcomes


# ---------------------------------------------------------------------------- shell
def _load_syncfs() -> Callable[[int], None] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.syncfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs: {os.strerror(code)}")
    return syncfs


def _kernel_reports_syncfs_errors() -> bool:
    """syncfs reports writeback errors from Linux 5.8 on; before, it only says EBADF."""
    if not os.uname().sysname == "Linux":
        return False
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def failpoint_syncfs(syncfs: Callable[[int], None]) -> Callable[[int], None]:
    def guarded(fd: int) -> None:
        failpoints.before_sync("syncfs")
        syncfs(fd)
    return guarded


class LogSync:
    """A log's way to the barrier: submit(fd, wake) when it needs what it has written so
    far (through descriptor `fd`) to be durable. Take a new one each time the log is
    (re)opened: in syncfs mode it carries the filesystem's error count as of then."""

    __slots__ = ("_barrier", "_loop", "_device", "_epoch", "_fsync", "_ringable")

    def __init__(self, barrier: DurabilityBarrier, loop, device: int | None, epoch: int,
                 fsync: Callable[[int], None] | None):
        self._barrier, self._loop = barrier, loop
        self._device, self._epoch, self._fsync = device, epoch, fsync
        # fsync mode with the default fsync: its loop's io_uring when there is one
        self._ringable = device is None and fsync is failpoints.fsync

    @property
    def mode(self) -> str:
        return SYNCFS if self._device is not None else FSYNC

    def submit(self, fd: int, wake: Callable[[], object] | None = None) -> SyncTicket:
        if self._ringable:
            ring = self._barrier.loop_ring(self._loop)
            if ring is not None:
                return ring.submit(fd, wake)
        ticket = SyncTicket(wake)
        if self._device is not None:  # the filesystem's descriptor is the barrier's
            request = Request(ticket, self._loop, device=self._device, opened_epoch=self._epoch,
                              submitted=time.perf_counter())
        else:  # a duplicate: the log may close its descriptor (roll, reopen) meanwhile
            request = Request(ticket, self._loop, fd=os.dup(fd), fsync=self._fsync,
                              submitted=time.perf_counter())
        self._barrier._submit(request)
        return ticket

    async def sync(self, fd: int) -> None:
        """Submit and wait (rare paths: a final flush)."""
        future = self._loop.create_future()
        ticket = self.submit(fd, lambda: future.done() or future.set_result(None))
        await future
        error = ticket.exception()
        if error is not None:
            raise error


class DurabilityBarrier:
    """The shell: one syncer thread (started on first use), one descriptor per
    filesystem for syncfs, and one hand-back per event loop per round."""

    def __init__(self, *, syncfs: Callable[[int], None] | None = None,
                 fsync: Callable[[int], None] = failpoints.fsync):
        """`syncfs` and `fsync` sync a descriptor or raise OSError; by default the
        kernel's syncfs (None where it does not report writeback errors) and os.fsync,
        both behind the fault harness's fsync failpoint."""
        probe = syncfs
        if syncfs is None:
            probe = _load_syncfs() if _kernel_reports_syncfs_errors() else None
            syncfs = failpoint_syncfs(probe) if probe is not None else None
        self._syncfs = syncfs
        self._probe = probe  # not behind the failpoint: it asks whether syncfs works
        self._fsync = fsync
        self._core = BarrierCore()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # fsync mode: a round's fsyncs
        # fsync mode: each event loop's fsyncs through its own io_uring instead (LoopRing;
        # only with the default fsync: a test's own fsync keeps the threads).
        self._loop_rings: dict[object, LoopRing] = {}
        self._ring_wanted = fsync is failpoints.fsync  # False too once io_uring is refused
        self._device_fds: dict[int, int] = {}  # st_dev -> a descriptor on it, for syncfs
        self._unusable: set[int] = set()  # devices where syncfs failed its probe
        self.rounds = 0  # metrics and tests
        self.syncs = 0

    def use_ring(self, wanted: bool) -> None:
        """Whether fsync mode goes through io_uring (partition.fsync_ring; on by default,
        and only with the default fsync): from the next request on (fsyncs in flight on
        a ring finish there)."""
        with self._lock:
            self._ring_wanted = wanted and self._fsync is failpoints.fsync

    def loop_ring(self, loop) -> LoopRing | None:
        """`loop`'s ring for fsync mode, made on first use; None when the ring is not
        wanted, io_uring is refused here, or the caller is not on the loop's thread
        (then the syncer thread and its pool serve it)."""
        ring = self._loop_rings.get(loop)
        if ring is not None and not ring.closed and self._ring_wanted:
            return ring if ring.thread == threading.get_ident() else None
        if not self._ring_wanted or loop.is_closed():
            return None
        with self._lock:
            for other in [o for o, r in self._loop_rings.items() if r.closed or o.is_closed()]:
                self._loop_rings.pop(other).close()  # a closed loop's (a test's): freed
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            return None
        ring = LoopRing.open(loop, self)
        with self._lock:
            if ring is None:
                if self._ring_wanted:
                    log.info("io_uring is not usable here: fsyncs use the barrier's threads")
                self._ring_wanted = False
                return None
            self._loop_rings[loop] = ring
        return ring

    def open(self, directory: str | os.PathLike, mode: str,
             fsync: Callable[[int], None] | None = None, loop=None) -> LogSync:
        """The LogSync of a log in `directory`, answered on `loop` (default: the running
        one). mode auto is syncfs or fsync by the directory's filesystem (barrier_mode);
        syncfs falls back to fsync where syncfs is not usable; `fsync` (tests) replaces
        the per-file sync and implies per-file mode. The first open on a filesystem
        probes syncfs there (one syncfs: may block; any thread may call)."""
        assert mode in (AUTO, SYNCFS, FSYNC), mode
        loop = loop or asyncio.get_running_loop()
        if mode == AUTO:
            mode = barrier_mode(mode, os.stat(directory).st_dev, os.stat("/").st_dev)
        if mode == SYNCFS and fsync is None and self._syncfs is not None:
            device = os.stat(directory).st_dev
            with self._lock:
                known = device in self._device_fds or device in self._unusable
            if not known:  # probed outside the lock: submits from event loops go on
                self._open_device(device, directory)
            with self._lock:
                if device in self._device_fds:
                    return LogSync(self, loop, device, self._core.error_epoch(device), None)
        return LogSync(self, loop, None, 0, fsync or self._fsync)

    def _open_device(self, device: int, directory) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._probe(fd)  # a kernel or filesystem without syncfs says so here
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                with self._lock:
                    self._unusable.add(device)
                log.warning("syncfs unusable on %s (%s): fsync per file there", directory, error)
                return
            raise
        with self._lock:
            if device in self._device_fds:  # another log's open probed it meanwhile
                os.close(fd)
            else:
                self._device_fds[device] = fd

    def _submit(self, request: Request) -> None:
        with self._lock:
            self._core.submit(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._syncer, name="durability",
                                                daemon=True)
                self._thread.start()
            elif not self._core.running:
                self._wake.notify()

    def _syncer(self) -> None:
        core = self._core
        while True:
            with self._lock:
                round_ = core.begin_round()
                while round_ is None:
                    self._wake.wait()
                    round_ = core.begin_round()
                device_fds = [(device, self._device_fds[device]) for device in round_.devices]
            began = time.perf_counter()
            for request in round_.requests:
                WAIT_SECONDS.observe(began - request.submitted)
            try:
                device_errors, file_errors = self._sync_round(round_, device_fds)
                ROUND_SECONDS.observe(time.perf_counter() - began)
            except BaseException as error:  # noqa: BLE001 — the thread itself failed (no
                # thread for the pool at interpreter exit, ...): fail the whole round
                # closed rather than leave its owners waiting. (Duplicates it did not
                # reach stay open: closing them blindly could close a reused number.)
                device_errors = {device: error for device in round_.devices}
                file_errors = {id(request): error for request in round_.files}
            with self._lock:
                outcomes = core.end_round(round_, device_errors, file_errors)
                self.rounds += 1
                self.syncs += len(device_fds) + len(round_.files)
            ROUNDS.inc()
            if device_fds:
                _SYNCFS_CALLS.inc(len(device_fds))
            if round_.files:
                _FSYNC_CALLS.inc(len(round_.files))
            REQUESTS.inc(len(outcomes))
            by_loop: dict[object, list] = {}
            for request, error in outcomes:
                by_loop.setdefault(request.loop, []).append((request.ticket, error))
            for loop, answers in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_answer, answers)
                except RuntimeError:  # that loop is closed: nobody waits there any more
                    pass

    def _sync_round(self, round_: Round, device_fds: list[tuple[int, int]]
                    ) -> tuple[dict[int, BaseException], dict[int, BaseException]]:
        """The syscalls of one round; the errors by device and by id() of the request."""
        device_errors: dict[int, BaseException] = {}
        file_errors: dict[int, BaseException] = {}
        for device, fd in device_fds:
            try:
                self._syncfs(fd)
            except BaseException as error:  # noqa: BLE001 — answered to every log on it
                device_errors[device] = error
        files = round_.files
        if len(files) > 1:  # at once: the kernel commits concurrent fsyncs together
            if self._pool is None:
                self._pool = ThreadPoolExecutor(FSYNC_THREADS, "durability-fsync")
            for request, error in zip(files, self._pool.map(_fsync_closing, files)):
                if error is not None:
                    file_errors[id(request)] = error
        elif files:
            error = _fsync_closing(files[0])
            if error is not None:
                file_errors[id(files[0])] = error
        return device_errors, file_errors


def _fsync_closing(request: Request) -> BaseException | None:
    try:
        request.fsync(request.fd)
    except BaseException as error:  # noqa: BLE001 — answered to its owner
        return error
    finally:
        os.close(request.fd)
    return None


def _answer(answers: list[tuple[SyncTicket, BaseException | None]]) -> None:
    """On an event loop: finish the round's tickets, then wake their owners."""
    for ticket, error in answers:
        ticket.finish(error)
    for ticket, _ in answers:
        if ticket.wake is not None:
            ticket.wake()


class LoopRing:
    """fsync mode on one event loop through io_uring, with no thread in between.

    `submit` dups the log's descriptor and queues its fsync; once per event-loop turn
    (call_soon) everything queued is written into the ring and submitted in one
    non-blocking io_uring_enter (the kernel hands fsyncs to its own workers, so the
    loop never blocks), and the fsyncs run at once. The kernel signals an eventfd
    registered with the ring for each completion; the loop reads it like a socket,
    reaps the completions, closes the duplicates and answers the tickets there. So an
    fsync costs the event loop's thread a few struct writes and its share of one system
    call per turn, and no other thread takes the GIL for it: the barrier's syncer
    thread (its wake-up, its Python work, its GIL hand-offs, a call_soon_threadsafe per
    round) is left to syncfs mode and to processes where io_uring is refused.

    Fsyncs of different turns overlap (up to the ring's `entries` in flight; more wait
    for a completion). The fault harness's failpoints apply at each turn's submission:
    armed, every fsync of it fails with EIO; fsync_slow delays the submission by the
    slow disk's time (call_later, never a sleep on the loop). If the ring itself fails
    (io_uring_enter refused), every fsync queued or in flight fails closed, the ring is
    closed (no later reader may take its completions) and the next request makes a new
    one."""

    def __init__(self, loop, barrier: DurabilityBarrier, ring: uring.Ring, efd: int):
        self._loop, self._barrier, self._ring, self._efd = loop, barrier, ring, efd
        self.thread = threading.get_ident()
        self._pending: list[tuple[SyncTicket, int, float]] = []  # (ticket, dup, submitted)
        # user_data -> (ticket, dup, when it was submitted to the kernel)
        self._in_flight: dict[int, tuple[SyncTicket, int, float]] = {}
        self._next = 0
        self._turn: asyncio.Handle | None = None
        self._watch: asyncio.TimerHandle | None = None  # while fsyncs are in flight
        self.closed = False
        loop.add_reader(efd, self._reap)

    @classmethod
    def open(cls, loop, barrier: DurabilityBarrier) -> LoopRing | None:
        """`loop`'s ring (call on its thread), or None where io_uring is refused."""
        ring = uring.Ring.open()
        if ring is None:
            return None
        try:
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            ring.close()
            return None
        try:
            ring.register_eventfd(efd)
        except OSError:
            os.close(efd)
            ring.close()
            return None
        return cls(loop, barrier, ring, efd)

    def submit(self, fd: int, wake: Callable[[], object] | None) -> SyncTicket:
        ticket = SyncTicket(wake)
        self._pending.append((ticket, os.dup(fd), time.perf_counter()))
        if self._turn is None:
            self._turn = self._loop.call_soon(self._flush)
        return ticket

    def _flush(self) -> None:
        self._turn = None
        if self.closed or not self._pending:
            return
        batch, self._pending = self._pending, []
        refused = failpoints.sync_refusal("fsync")
        if refused is not None:
            self._answer_closing([(ticket, fd, refused) for ticket, fd, _ in batch])
            return
        delay_s = failpoints.slow_disk_seconds()
        if delay_s:
            self._loop.call_later(delay_s, self._submit, batch)
        else:
            self._submit(batch)

    def _submit(self, batch: list[tuple[SyncTicket, int, float]]) -> None:
        if self.closed:  # failed meanwhile (a slow disk's delay): these fail with it
            self._answer_closing([(ticket, fd, OSError(errno.EIO, "fsync: its io_uring "
                                   "failed")) for ticket, fd, _ in batch])
            return
        room = self._ring.entries - len(self._in_flight)
        if len(batch) > room:  # the rest when completions make room (_reap)
            self._pending[:0] = batch[room:]
            batch = batch[:room]
        if not batch:
            return
        now = time.perf_counter()
        for ticket, fd, submitted in batch:
            WAIT_SECONDS.observe(now - submitted)
            user_data = self._next
            self._next = (user_data + 1) & 0xFFFFFFFFFFFF
            self._in_flight[user_data] = (ticket, fd, now)
            self._ring.queue_fsync(fd, user_data)
        calls, flushes = self._ring.calls, self._ring.flushes
        try:
            done = self._ring.submit()
        except OSError as error:
            self._fail(error)
            return
        finally:
            self._count(calls, flushes)
        ROUNDS.inc()
        _FSYNC_CALLS.inc(len(batch))
        with self._barrier._lock:
            self._barrier.rounds += 1
            self._barrier.syncs += len(batch)
        if self._watch is None:
            self._watch = self._loop.call_later(WATCH_S, self._look_again)
        if done:
            self._answer_done(done)

    def _reap(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except (BlockingIOError, InterruptedError):
            pass
        if not self.closed:
            calls, flushes = self._ring.calls, self._ring.flushes
            try:
                done = self._ring.completions()
            except OSError as error:  # completions dropped: nothing in flight is known
                self._fail(error)
                return
            finally:
                self._count(calls, flushes)
            self._answer_done(done)

    def _count(self, calls: int, flushes: int) -> None:
        if self._ring.calls != calls:
            RING_CALLS.inc(self._ring.calls - calls)
            if self._ring.flushes != flushes:
                RING_FLUSHES.inc(self._ring.flushes - flushes)

    def _look_again(self) -> None:
        """Every WATCH_S while fsyncs are in flight: reads the completions as the eventfd
        would have the loop read them. The eventfd rings for each completion the kernel
        posts; this is for one it never rang for (a completion left on the kernel's
        overflow list past what one look flushes: partition_server/uring.py), which
        would otherwise keep its log waiting for good."""
        self._watch = None
        if self.closed or not self._in_flight:
            return
        self._reap()
        if not self.closed and self._in_flight and self._watch is None:
            self._watch = self._loop.call_later(WATCH_S, self._look_again)

    def _answer_done(self, done: list[tuple[int, int]]) -> None:
        answers = []
        now = time.perf_counter()
        for user_data, code in done:
            entry = self._in_flight.pop(user_data, None)
            if entry is not None:
                ticket, fd, submitted = entry
                ROUND_SECONDS.observe(now - submitted)
                answers.append((ticket, fd, OSError(code, f"fsync: {os.strerror(code)}")
                                if code else None))
        self._answer_closing(answers)
        if self._pending and self._turn is None:
            self._turn = self._loop.call_soon(self._flush)

    def _answer_closing(self, answers: list[tuple[SyncTicket, int, BaseException | None]]
                        ) -> None:
        for _, fd, _ in answers:
            os.close(fd)
        REQUESTS.inc(len(answers))
        _answer([(ticket, error) for ticket, _, error in answers])

    def _fail(self, error: OSError) -> None:
        """The ring failed: nothing queued or in flight is known to be durable."""
        log.warning("an io_uring fsync submission failed (%s): its logs fail closed", error)
        failed = [(ticket, fd, error) for ticket, fd, _ in self._in_flight.values()]
        failed += [(ticket, fd, error) for ticket, fd, _ in self._pending]
        self._in_flight, self._pending = {}, []
        self.close()
        self._answer_closing(failed)

    def close(self) -> None:
        """Stop using the ring (a failure; a closed loop's). What is still in flight is
        not answered: only a failure closes a live loop's ring, and it answers first."""
        if not self.closed:
            self.closed = True
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            if not self._loop.is_closed():
                self._loop.remove_reader(self._efd)
            self._ring.close()
            os.close(self._efd)
            for _, fd, _ in self._in_flight.values():
                os.close(fd)
            for _, fd, _ in self._pending:
                os.close(fd)
            self._in_flight, self._pending = {}, []


_BARRIER: DurabilityBarrier | None = None
_BARRIER_LOCK = threading.Lock()


def barrier() -> DurabilityBarrier:
    """This process's barrier."""
    global _BARRIER
    if _BARRIER is None:
        with _BARRIER_LOCK:
            if _BARRIER is None:
                _BARRIER = DurabilityBarrier()
    return _BARRIER


def _forget_after_fork() -> None:  # a child has no syncer thread: it makes its own
    global _BARRIER
    _BARRIER = None


os.register_at_fork(after_in_child=_forget_after_fork)
