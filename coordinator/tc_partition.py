"""One leased TC partition: the shell around its pure core (coordinator/core.py).

Everything runs on the process's event loop; the core is only ever called from it, so no
lock is needed (one owner per TC partition). Life of a lease:

    LOADING   fence the log with the new epoch (a deposed owner can no longer append),
              read it from its start to the fence, restore the newest complete snapshot,
              replay the records after it, tick once (markers of every decided
              transaction go out again, with the new epoch)
    ACTIVE    calls run against the core; the Ready each returns is carried out in the
              core's effect order: its appends go to the writer, which batches everything
              queued into one TC log append and, once durable, feeds append_done back in
              order; the caller hears back after its appends are durable; markers go to
              the marker channel; confirmations come back as marker_confirmed; a ticker
              drives timeouts, completions and re-sends
    STOPPED   the lease is gone (released, ZooKeeper session lost, or fenced by a newer
              owner: PRODUCER_FENCED on an append, STALE_COORDINATOR_EPOCH on a marker):
              every waiting call fails with NOT_COORDINATOR and the core is dropped

A load that fails (the log unreadable, a partition server down) is retried with backoff
while the lease lasts; calls meanwhile answer the retriable COORDINATOR_LOADING.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Awaitable, Callable

from coordinator import metrics
from coordinator.core import (
    Append,
    Limits,
    Ready,
    SnapshotCorrupt,
    TcPartitionCore,
    replay,
)
from coordinator.markers import MarkerChannel
from coordinator.records import (
    Completed,
    Decided,
    EndCause,
    Opened,
    RecordCorrupt,
    SubscriptionPartition,
    TopicPartition,
    TxnId,
    decode_record,
    encode_record,
)
from coordinator.routing import PartitionRoutes
from coordinator.txn_log import (
    KEY_SNAPSHOT,
    SNAPSHOT_CHUNK_BYTES,
    AppendChannel,
    AppendRejected,
    Fenced,
    SnapshotAssembler,
    TxnLog,
    append_outcome,
    chunk_bytes_within,
    snapshot_chunks,
)
from services import acl
from services.batching import failure_of, observe_failure
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.coordinator.tc_partition")

MAX_APPEND_BYTES = 768 << 10  # one TC log batch: inside the 1 MiB default batch limit
# An idle TC partition still appends (a fence record) this often, so the partition server
# never expires the log's producer state (partition.producer_idle_expiry_ms, 1 day by
# default): expired, it would forget the newest epoch and could no longer fence an older
# owner, and it would refuse the owner's next sequence as UNKNOWN_PRODUCER_ID.
KEEPALIVE_S = 3_600.0
# An idle core's tick (nothing unfinished: only sessions to expire, keepalives and
# snapshots to start) comes this often, or at once when an input arrives: 16 idle TC
# partitions ticking every 100 ms took most of an idle server's CPU.
IDLE_TICK_S = 1.0


class Phase(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    LOADING = "loading"
    ACTIVE = "active"
    STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The coordinator.* settings a TC partition uses (same names, same defaults)."""

    tick_interval_ms: int = 100
    snapshot_every_records: int = 20_000
    snapshot_interval_ms: int = 300_000
    log_request_timeout_ms: int = 5_000
    max_pending_calls: int = 10_000
    completion_linger_ms: int = 200
    parallel_commits: str = "auto"  # "auto", "on" or "off" (services/config.py)
    commit_lane: bool = True
    lane_one_round: bool = True


# A parallel commit's resolution (StageChannel.resolve): (txn_id, coordinator epoch, its
# partitions) -> True (durable on every one), False (not on one, fenced), None (no answer).
Resolver = Callable[[TxnId, int, tuple["TopicPartition | SubscriptionPartition", ...]],
                   Awaitable["bool | None"]]


def now_ms() -> int:
    return int(time.time() * 1000)


class TcPartition:
    def __init__(self, tc_partition: int, epoch: int, log_producer_id: int, *,
                 coordinator_name: str, routes: PartitionRoutes, log_channel: AppendChannel,
                 markers: MarkerChannel, limits: Limits, settings: Settings,
                 on_fenced: Callable[[int], Awaitable[None]],
                 resolver: Resolver | None = None):
        self.tc_partition = tc_partition
        self.epoch = epoch
        self.coordinator_name = coordinator_name
        self.markers = markers
        self.limits = limits
        self.settings = settings
        self.on_fenced = on_fenced
        self.resolver = resolver
        self._resolving: set[asyncio.Task] = set()
        self.log = TxnLog(routes, log_channel, tc_partition, log_producer_id, epoch,
                          settings.log_request_timeout_ms / 1000)
        self.phase = Phase.LOADING
        self.core: TcPartitionCore | None = None
        self.load_seconds: float | None = None
        self.load_error = ""
        self._queue: deque[Append] = deque()
        self._append_futures: dict[int, asyncio.Future] = {}
        self._completion_waiters: dict[TxnId, list[asyncio.Future]] = {}
        self._wake = asyncio.Event()
        self._input = asyncio.Event()  # set by every input carried out: wakes an idle ticker
        self._tasks: list[asyncio.Task] = []
        self._log_end = 0
        self._records_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        self._snapshot_id = 0
        # Snapshot chunks fit in the TC log's batches: smaller once a chunk was refused
        # as too large (`_maybe_snapshot`).
        self._snapshot_chunk_bytes = SNAPSHOT_CHUNK_BYTES
        self._trim: asyncio.Task | None = None
        self._last_append_at = time.monotonic()
        # Appends started in the caller's step (the commit lane's decisions, `lane`):
        # The writer's own append, snapshot or keepalive is on the log: one at a time, so
        # the lane's appends (`_append_now`) wait for it (and it for theirs, `_in_flight`).
        self._writer_on_log = False
        self._append_scheduled = False
        self._in_flight: tuple | None = None  # (group, entries, started, future)
        self._returned: tuple | None = None  # (group, entries, error): the writer retries
        self._linger_timer: asyncio.TimerHandle | None = None  # (_linger_here)
        self._lingered = False  # what is queued has lingered already (_linger_here)
        self._giving_up: asyncio.Task | None = None  # after a bug in _appended_here

    # ================================================================ life cycle

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name=f"tc-{self.tc_partition}"))

    async def stop(self, reason: str) -> None:
        """The lease is gone: stop acting, fail every waiting call, drop the core."""
        if self.phase is Phase.STOPPED:
            return
        self.phase = Phase.STOPPED
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        current = asyncio.current_task()
        tasks = [t for t in [*self._tasks, self._trim, *self._resolving]
                 if t is not None and t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        error = AtomlogError("NOT_COORDINATOR", f"TC partition {self.tc_partition} moved "
                             f"away from {self.coordinator_name} ({reason}); look up its "
                             "owner again", {"tc_partition": str(self.tc_partition)})
        for future in [*self._append_futures.values(),
                       *(f for fs in self._completion_waiters.values() for f in fs)]:
            if not future.done():
                future.set_exception(error)
                # Appends the partition made for itself (timeouts, aborts) have no caller
                # waiting: not an error to log ("never retrieved"); a caller still gets it.
                observe_failure(future)
        self._append_futures.clear()
        self._completion_waiters.clear()
        self._queue.clear()
        self.core = None
        event(log, "TC partition stopped", tc_partition=self.tc_partition, epoch=self.epoch,
              reason=reason)

    async def _fenced(self, why: str) -> None:
        event(log, "TC partition fenced by a newer owner", tc_partition=self.tc_partition,
              epoch=self.epoch, why=why)
        await self.stop("fenced")
        await self.on_fenced(self.tc_partition)

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._load()
                break
            except Fenced as error:
                await self._fenced(str(error))
                return
            except Exception as error:
                attempt += 1
                self.load_error = f"{type(error).__name__}: {error}"
                metrics.LOAD_FAILURES.inc()
                log.exception("loading TC partition %d failed (attempt %d)",
                              self.tc_partition, attempt)
                await asyncio.sleep(min(5.0, 0.1 * 2 ** attempt))
        self._tasks.append(asyncio.create_task(self._guarded(self._ticker, "ticker"),
                                               name=f"tc-{self.tc_partition}-tick"))
        await self._guarded(self._writer, "log writer")

    async def _guarded(self, body: Callable[[], Awaitable[None]], what: str) -> None:
        """Run the writer or the ticker. Either dying of an unexpected exception (a bug)
        would leave the TC partition leased but deaf — every call waiting for an append
        that never comes, no timeouts, no marker re-sends — and silent, as nobody awaits
        these tasks. So it is logged, the waiting calls fail, and the lease is given up
        so that a fresh owner reloads the TC partition from its log."""
        try:
            await body()
        except Exception:  # noqa: BLE001 — see above
            log.exception("TC partition %d: its %s failed; giving up the lease",
                          self.tc_partition, what)
            await self._give_up(what)

    async def _give_up(self, what: str) -> None:
        await self.stop(f"{what} failed")
        await self.on_fenced(self.tc_partition)

    async def _load(self) -> None:
        started = time.perf_counter()
        fence_offset = await self.log.fence(self.coordinator_name)
        start, _ = await self.log.offsets()
        assembler = SnapshotAssembler()
        base: TcPartitionCore | None = None
        covered = start
        tail: list[tuple[int, bytes]] = []
        async for entry in self.log.read(start, fence_offset):
            if entry.key is None:
                tail.append((entry.offset, entry.value))
            elif entry.key == KEY_SNAPSHOT:
                data = assembler.add(entry)
                if data is None:
                    continue
                try:
                    base, covered = TcPartitionCore.restore(data, self.tc_partition,
                                                            self.limits, self.epoch)
                except SnapshotCorrupt as error:
                    # Keep the previous base and the records after it: a full replay
                    # from there gives the same table.
                    event(log, "snapshot unusable; replaying past it",
                          tc_partition=self.tc_partition, offset=assembler.first_offset,
                          error=str(error))
                    continue
                tail = [(offset, value) for offset, value in tail if offset >= covered]
        try:
            records = [decode_record(value) for offset, value in tail if offset >= covered]
        except RecordCorrupt as error:
            raise AtomlogError("INTERNAL", f"__txn_log-{self.tc_partition}: {error}") from None
        core = replay(records, self.tc_partition, self.limits, self.epoch, base=base)
        self.core = core
        self._log_end = fence_offset + 1
        self._records_since_snapshot = len(records)
        self.phase = Phase.ACTIVE
        self.load_seconds = time.perf_counter() - started
        self.load_error = ""
        metrics.LOAD_SECONDS.observe(self.load_seconds)
        event(log, "TC partition loaded", tc_partition=self.tc_partition, epoch=self.epoch,
              seconds=round(self.load_seconds, 3), log_start=start, fence_offset=fence_offset,
              snapshot=base is not None, replayed=len(records),
              unfinished=core.metrics.unfinished_transactions,
              finished=core.metrics.finished_transactions)
        self._carry_out(core.tick(now_ms()))
        self._start_resolutions()

    # ================================================================ calls

    def require_active(self) -> TcPartitionCore:
        if self.phase is Phase.ACTIVE and self.core is not None:
            return self.core
        if self.phase is Phase.LOADING:
            raise AtomlogError("COORDINATOR_LOADING",
                               f"TC partition {self.tc_partition} is loading its log"
                               + (f" (last attempt failed: {self.load_error})"
                                  if self.load_error else ""),
                               {"tc_partition": str(self.tc_partition), "retry_after_ms": "200"})
        raise AtomlogError("NOT_COORDINATOR", f"TC partition {self.tc_partition} is no longer "
                           f"owned by {self.coordinator_name}",
                           {"tc_partition": str(self.tc_partition)})

    async def call(self, action: Callable[[TcPartitionCore, int], Ready]):
        """Run one input against the core and carry out its Ready; the reply once every
        append of it is durable (at once for Ready.early_reply: a parallel commit's
        decision, whose append's failure the core handles itself). A refused input
        raises and changes nothing."""
        reply, futures = self._call(action, early=False)
        if futures:
            # asyncio.wait: a cancelled caller must not cancel the append itself.
            await asyncio.wait(futures)
            for future in futures:
                future.result()  # raises the append's failure
        return reply

    def call_parallel(self, action: Callable[[TcPartitionCore, int], Ready]):
        """As call, without waiting: (reply, the futures of its appends), for a parallel
        commit's begin, whose Staging record is waited for together with the stages."""
        return self._call(action, early=True)

    def call_now(self, action: Callable[[TcPartitionCore, int], Ready]):
        """As call, without waiting, for the commit lane (coordinator/lane.py): (reply, the
        futures of its appends). The appends start in a callback of this event-loop turn
        (or in the lane's step: `append_scheduled_now`) unless the writer is on the log
        (its own append, snapshot or keepalive), as every call's do (`_append_now`), so
        the writer's task does not wake for them; else the writer takes them. Unlike
        `call`, Completed records do not linger for company here."""
        return self._call(action, early=False, lane=True)

    def _call(self, action: Callable[[TcPartitionCore, int], Ready], early: bool,
              lane: bool = False):
        core = self.require_active()
        if len(self._queue) >= self.settings.max_pending_calls:
            raise AtomlogError("RESOURCE_EXHAUSTED", f"TC partition {self.tc_partition} has "
                               f"{len(self._queue)} appends waiting (limit "
                               "coordinator.max_pending_calls); retry later",
                               {"limit": "coordinator.max_pending_calls",
                                "retry_after_ms": "100"})
        ready = action(core, now_ms())
        futures = self._carry_out(ready, lane)
        if ready.early_reply and not early:
            for future in futures:  # nobody awaits it: its failure is the core's to handle
                future.add_done_callback(observe_failure)
            return ready.reply, []
        return ready.reply, futures

    def query(self, action: Callable[[TcPartitionCore, int], object]):
        return action(self.require_active(), now_ms())

    async def wait_completed(self, txn_id: TxnId, timeout_s: float | None) -> bool:
        """Wait until the transaction is COMMITTED/ABORTED (True), or the timeout."""
        core = self.require_active()
        if core.is_finished(txn_id):
            return True
        future = asyncio.get_running_loop().create_future()
        self._completion_waiters.setdefault(txn_id, []).append(future)
        self._wake.set()  # a lingering completion goes out now (_linger_for_company)
        self.markers.hurry()  # and lingering markers (coordinator/markers.py)
        done, _ = await asyncio.wait([future], timeout=timeout_s)
        if future in done:
            future.result()
            return True
        waiters = self._completion_waiters.get(txn_id, [])
        if future in waiters:
            waiters.remove(future)
        return False

    # ================================================================ effects

    def _carry_out(self, ready: Ready, lane: bool = False) -> list[asyncio.Future]:
        """Queue the appends (returning their futures), send the markers, wake the
        waiters of completed transactions. `lane`: the appends start without the writer
        when they can (`call_now`)."""
        futures = []
        loop = asyncio.get_running_loop()
        self._input.set()
        for append in ready.appends:
            future = loop.create_future()
            self._append_futures[append.append_id] = future
            self._queue.append(append)
            futures.append(future)
        if ready.appends:
            # Started in a callback at the end of this turn (or in the commit lane's
            # step), not by the writer's task: `_append_soon`, which leaves them to the
            # writer while it is on the log. Completed records nobody waits for linger
            # for company first (`_linger_here`).
            if not lane and self._may_linger(ready.appends):
                self._linger_here()
            else:
                self._append_soon()
        if ready.markers:
            core = self.core
            self.markers.send(self, ready.markers,
                              may_linger=core.is_one_call if core is not None else None)
        for txn_id in ready.completed:
            acl.transaction_completed(txn_id.tc_partition, txn_id.sequence)
            for future in self._completion_waiters.pop(txn_id, []):
                if not future.done():
                    future.set_result(True)
        return futures

    async def _writer(self) -> None:
        while self.phase is Phase.ACTIVE:
            await self._wake.wait()
            self._wake.clear()
            await self._linger_for_company()
            while (self._queue or self._returned) and self.phase is Phase.ACTIVE:
                if self._in_flight is not None:  # the lane's append: its sequence first
                    await asyncio.wait([self._in_flight[3]])  # (_appended_here has run)
                    continue  # (which may have taken the queue on)
                failed = None
                if self._returned is not None:
                    (group, entries, failed), self._returned = self._returned, None
                else:
                    group, entries = self._take_group()
                started = time.perf_counter()
                self._writer_on_log = True
                try:
                    _, last = await self.log.append(entries, failed)
                except Fenced as error:
                    self._writer_on_log = False
                    await self._fenced(str(error))
                    return
                except AppendRejected as rejected:
                    self._writer_on_log = False
                    event(log, "TC log append refused; rolling back its transitions",
                          tc_partition=self.tc_partition, reason=rejected.error.reason,
                          detail=rejected.error.message)
                    for append in group:
                        ready = self.core.append_failed(append.append_id)
                        self._settle(append.append_id, rejected.error)
                        self._carry_out(ready)
                    continue
                finally:
                    self._writer_on_log = False
                self._appended(group, len(entries), last, started)
            if self._in_flight is not None:  # (nothing of the lane's in flight below)
                await asyncio.wait([self._in_flight[3]])
            if self.phase is Phase.ACTIVE and not self._queue and self.core is not None \
                    and self._in_flight is None:
                self._writer_on_log = True
                try:
                    await self._maybe_snapshot()  # (due by time, or after the lane's appends)
                finally:
                    self._writer_on_log = False
            if (self.phase is Phase.ACTIVE and not self._queue and self._in_flight is None
                    and time.monotonic() - self._last_append_at >= KEEPALIVE_S):
                self._writer_on_log = True
                try:
                    self._log_end = await self.log.fence(self.coordinator_name) + 1
                except Fenced as error:
                    await self._fenced(str(error))
                    return
                finally:
                    self._writer_on_log = False
                self._last_append_at = time.monotonic()

    def _appended(self, group: list[Append], records: int, last: int,
                  started: float) -> None:
        """A group's append is durable: the core and the callers hear of it."""
        self._last_append_at = time.monotonic()
        metrics.LOG_APPEND_SECONDS.observe(time.perf_counter() - started)
        metrics.LOG_RECORDS_PER_APPEND.observe(records)
        self._log_end = last + 1
        self._records_since_snapshot += records
        now = now_ms()
        for append in group:
            _count(append)
            ready = self.core.append_done(append.append_id, now)
            self._settle(append.append_id, None)
            self._carry_out(ready)

    def _append_soon(self) -> None:
        """The queued appends go in a callback at the end of this event-loop turn (every
        decision of the turn in one batch) unless the writer is on the log or has a
        failed attempt to retry first; then the writer takes them."""
        if self._append_scheduled or self._in_flight is not None:
            return  # (the append in flight takes the queue on when it ends)
        if self._writer_on_log or self._returned is not None:
            self._wake.set()  # (it takes them once its own work on the log ends)
            return
        self._append_scheduled = True
        asyncio.get_running_loop().call_soon(self._append_now)

    def appends_in_step(self) -> bool:
        """Whether a decision made now is appended and written in the commit lane's step
        (CommitLane._stage_in_step): active, the writer neither on the log nor holding a
        failed attempt, no append in flight, and the log's owner here writing in the
        step, in the write-ahead file its stages are in. Else its decision could become
        durable apart from its stages (on another server, or in its own fsync)."""
        if (self.phase is not Phase.ACTIVE or self._writer_on_log
                or self._returned is not None or self._in_flight is not None):
            return False
        return self.log.takes_gathered(len(self._queue) * 2 + 2)

    def appends_follow_here(self) -> bool:
        """Whether this TC partition's appends from now on are written by this process's
        owner of its log, in the write-ahead file (TxnLog.takes_gathered), so after
        every frame written there before them: the commit lane then confirms markers
        written in its step at once (CommitLane._riders_in_step)."""
        return self.phase is Phase.ACTIVE and self.log.takes_gathered(0)

    def append_scheduled_now(self) -> None:
        """The commit lane's step: the append `_append_soon` scheduled, made now."""
        if self._append_scheduled:
            self._append_now()

    def _may_linger(self, appends) -> bool:
        """Whether appends may wait for company without the writer (`_linger_here`): as
        `_linger_for_company`, Completed records nobody waits for."""
        return (self.settings.completion_linger_ms > 0 and not self._completion_waiters
                and all(isinstance(r, Completed) for a in appends for r in a.records))

    def _linger_here(self) -> None:
        """`_linger_for_company` without the writer's task: the Completed records stay
        queued for the next append (the commit lane's decisions take them along) or, at
        the latest after completion_linger_ms, go in one of their own (`_append_soon`)."""
        if self._linger_timer is None:
            self._linger_timer = asyncio.get_running_loop().call_later(
                self.settings.completion_linger_ms / 1000, self._linger_ended)

    def _linger_ended(self) -> None:
        self._linger_timer = None
        if self._queue and self.phase is Phase.ACTIVE:
            self._lingered = True  # (should the writer take them: no second linger)
            self._append_soon()

    def _append_now(self) -> None:
        """The writer's append step in a callback: the queued group encoded and queued on
        this process's owner of the TC log, or on the next Produce call to its partition
        server (TxnLog.append_here), answered in `_appended_here`. Anything else (the
        writer on the log, the log's server not known) wakes the writer, which appends
        as always. One append at a time, the writer's or this
        one (`_in_flight`, which the writer waits for): the log's sequence numbers allow
        no other."""
        self._append_scheduled = False
        if (self.phase is not Phase.ACTIVE or not self._queue or self._in_flight is not None
                or self._returned is not None or self._writer_on_log):
            if self._queue:
                self._wake.set()
            return
        group, entries = self._take_group()
        self._lingered = False
        try:
            future = self.log.append_here(entries)
        except Exception:  # noqa: BLE001 — a bug: the writer appends them instead
            log.exception("TC partition %d: appending in this process failed",
                          self.tc_partition)
            future = None
        if future is None:
            self._queue.extendleft(reversed(group))
            self._wake.set()
            return
        bounded = _answered_within(future, self.settings.log_request_timeout_ms / 1000)
        self._in_flight = (group, entries, time.perf_counter(), bounded)
        bounded.add_done_callback(self._appended_here)

    def _appended_here(self, future: asyncio.Future) -> None:
        group, entries, started, _ = self._in_flight
        self._in_flight = None
        if self.phase is not Phase.ACTIVE or self.core is None:
            return  # stopped meanwhile: its callers were failed then
        outcome = failure_of(future, "the TC log's append")
        if outcome is None:
            outcome = append_outcome(future.result())
        if isinstance(outcome, AtomlogError):
            # The writer goes on as after any failed attempt of this batch: retried (same
            # sequence), refused (rolled back) or the TC partition reloaded.
            self._returned = (group, entries, outcome)
            self._wake.set()
            return
        self.log.appended(len(entries))
        try:
            self._appended(group, len(entries), outcome.last_offset, started)
        except Exception:  # noqa: BLE001 — a bug, as the writer's in _guarded
            # In a callback nobody awaits: the core's pending appends would never be
            # completed and its callers never answered, while the lease is kept.
            log.exception("TC partition %d: completing an append made in this process "
                          "failed; giving up the lease", self.tc_partition)
            self._giving_up = asyncio.ensure_future(self._give_up("an append's completion"))
            return
        if self._queue:
            if self._may_linger(self._queue):
                self._linger_here()
            else:
                self._append_soon()
        elif self._records_since_snapshot >= self.settings.snapshot_every_records:
            self._wake.set()  # the writer snapshots

    async def _linger_for_company(self) -> None:
        """When everything queued is Completed records, wait (up to completion_linger_ms)
        for another append to share the TC log call: a completion needs no reply and
        loses nothing by waiting (its markers are confirmed, and a load re-sends markers of
        an uncompleted transaction anyway), so under load it costs no call of its own.
        Not while a caller waits for a completion (EndTxn wait_for_markers)."""
        linger_s = self.settings.completion_linger_ms / 1000
        lingered, self._lingered = self._lingered, False
        if not linger_s or lingered:
            return
        deadline = time.monotonic() + linger_s
        while self.phase is Phase.ACTIVE and self._queue and self._may_linger(self._queue):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                async with asyncio.timeout(remaining):  # no task, as wait_for would make
                    await self._wake.wait()
            except TimeoutError:
                return
            self._wake.clear()

    def _take_group(self) -> tuple[list[Append], list[tuple[None, bytes]]]:
        """The queued appends that fit one TC log batch, and their encoded records."""
        group: list[Append] = []
        entries: list[tuple[None, bytes]] = []
        size = 0
        while self._queue:
            encoded = [encode_record(r) for r in self._queue[0].records]
            append_size = 64 * len(encoded) + sum(map(len, encoded))
            if group and size + append_size > MAX_APPEND_BYTES:
                break
            group.append(self._queue.popleft())
            entries.extend([(None, value) for value in encoded])
            size += append_size
        return group, entries

    def _settle(self, append_id: int, error: AtomlogError | None) -> None:
        future = self._append_futures.pop(append_id, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            observe_failure(future)  # (as in stop: an append of its own has no caller)

    async def _ticker(self) -> None:
        interval = self.settings.tick_interval_ms / 1000
        loop = asyncio.get_running_loop()
        idle_until: float | None = None  # when an idle core's next tick is due
        while self.phase is Phase.ACTIVE:
            if self.core is not None and self.core.idle():
                # Nothing to time out, complete or re-send: the next tick (sessions,
                # keepalives, snapshots) in about a second. An input (_carry_out) wakes
                # this early: busy now, the 100 ms pace resumes; still idle (an append in
                # flight), the same tick stays due, however many inputs come meanwhile.
                if idle_until is None:
                    idle_until = loop.time() + max(interval, IDLE_TICK_S) * random.uniform(
                        0.9, 1.1)
                self._input.clear()
                timer = loop.call_at(idle_until, self._input.set)
                try:
                    await self._input.wait()
                finally:
                    timer.cancel()
                if loop.time() < idle_until:
                    continue
            else:
                await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            idle_until = None
            if self.phase is Phase.ACTIVE and self.core is not None:
                metrics.TICKS.inc()
                self._carry_out(self.core.tick(now_ms()))
                self._start_resolutions()
                idle = time.monotonic() - self._last_append_at
                if not self._queue and (idle >= KEEPALIVE_S or (
                        self._records_since_snapshot and time.monotonic()
                        - self._last_snapshot_at >= self.settings.snapshot_interval_ms / 1000)):
                    self._wake.set()  # the writer snapshots / keeps alive when idle

    # ================================================================ parallel commits

    def _start_resolutions(self) -> None:
        """Resolve every Staging transaction nobody decides (after a load, or left by a
        failed CommitTxn): ask its partitions, fencing older owners, then decide."""
        if self.resolver is None or self.core is None:
            return
        for txn_id, targets in self.core.staged_to_resolve():
            # Guarded as the writer and the ticker are: an error escaping the resolution
            # (a defect; the resolver's own failures are asked again) gives the lease up,
            # so a fresh owner reloads and resolves, instead of the task ending unread
            # with the transaction left Staging (Staging never times out) and its
            # partitions' max read position held.
            task = asyncio.create_task(
                self._guarded(functools.partial(self._resolve, txn_id, targets),
                              f"resolution of {txn_id}"),
                name=f"tc-{self.tc_partition}-resolve-{txn_id}")
            self._resolving.add(task)
            task.add_done_callback(self._resolving.discard)

    async def _resolve(self, txn_id: TxnId,
                       targets: tuple[TopicPartition | SubscriptionPartition, ...]) -> None:
        started = time.perf_counter()
        try:
            staged = await self.resolver(txn_id, self.epoch, targets)
        except Exception as error:  # noqa: BLE001 — asked again at a later tick
            event(log, "resolving a parallel commit failed; it is asked again",
                  tc_partition=self.tc_partition, txn_id=str(txn_id), error=repr(error))
            staged = None
        if self.phase is not Phase.ACTIVE or self.core is None:
            return
        if staged is not None:
            metrics.RESOLUTIONS.labels("commit" if staged else "abort").inc()
            event(log, "parallel commit resolved", tc_partition=self.tc_partition,
                  txn_id=str(txn_id), decision="COMMIT" if staged else "ABORT",
                  seconds=round(time.perf_counter() - started, 3))
        self._carry_out(self.core.resolve_staged(now_ms(), txn_id, staged))

    # ================================================================ markers

    def marker_confirmed(self, txn_id: TxnId, target, epoch: int) -> None:
        self.markers_confirmed(((txn_id, target),), epoch)

    def markers_confirmed(self, confirmed, epoch: int) -> None:
        """(txn_id, target) pairs confirmed by one answer, markers of `epoch`: their
        Completed records in one append (core.markers_confirmed)."""
        if self.phase is not Phase.ACTIVE or epoch != self.epoch or self.core is None:
            return
        self._carry_out(self.core.markers_confirmed(now_ms(), confirmed))

    def marker_epoch_stale(self, epoch: int) -> None:
        if self.phase is Phase.ACTIVE and epoch == self.epoch:
            self._tasks.append(asyncio.create_task(
                self._fenced("a partition server refused a marker as stale")))

    # ================================================================ snapshots

    async def _maybe_snapshot(self) -> None:
        due = (self._records_since_snapshot >= self.settings.snapshot_every_records
               or (self._records_since_snapshot and time.monotonic() - self._last_snapshot_at
                   >= self.settings.snapshot_interval_ms / 1000))
        if not due:
            return
        # Nothing is in flight here, so the durable table is exactly the log up to
        # _log_end: the snapshot covers it, and replay resumes after the chunks.
        data = self.core.snapshot(self._log_end)
        self._snapshot_id += 1
        snapshot_id = (self.epoch << 32) | self._snapshot_id
        first = -1
        for chunk in snapshot_chunks(snapshot_id, data, self._snapshot_chunk_bytes):
            try:
                base, last = await self.log.append([(KEY_SNAPSHOT, chunk)])
            except Fenced as error:
                await self._fenced(str(error))
                return
            except AppendRejected as rejected:
                smaller = chunk_bytes_within(rejected.error, self._snapshot_chunk_bytes)
                if smaller is not None:
                    # partition.max_batch_bytes below the chunk: the snapshot again, now,
                    # in chunks that fit (the chunks appended already are an interrupted
                    # snapshot, which a load skips). Each time smaller, so this ends.
                    event(log, "snapshot chunks made smaller", tc_partition=self.tc_partition,
                          chunk_bytes=smaller, limit=rejected.error.metadata.get("limit"))
                    self._snapshot_chunk_bytes = smaller
                    await self._maybe_snapshot()
                    return
                event(log, "snapshot append refused", tc_partition=self.tc_partition,
                      reason=rejected.error.reason, detail=rejected.error.message)
                self._last_snapshot_at = time.monotonic()
                return
            first = base if first < 0 else first
            self._log_end = last + 1
        self._records_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        metrics.SNAPSHOTS.inc()
        metrics.SNAPSHOT_BYTES.set(len(data))
        if self._trim is None or self._trim.done():
            self._trim = asyncio.create_task(self._delete_before(first))

    async def _delete_before(self, offset: int) -> None:
        try:
            log_start = await self.log.delete_before(offset)
            event(log, "TC log trimmed below its snapshot", tc_partition=self.tc_partition,
                  before_offset=offset, log_start=log_start)
        except AtomlogError as error:  # best effort: the next snapshot tries again
            event(log, "TC log trim failed", tc_partition=self.tc_partition,
                  reason=error.reason, detail=error.message)


def _answered_within(future: asyncio.Future, timeout_s: float) -> asyncio.Future:
    """`future`'s outcome, or REQUEST_TIMED_OUT when it has none within `timeout_s` (a
    write whose outcome is unknown: the writer sends the same batch again, which the
    log's producer sequence de-duplicates). An append made in this process waits on its
    owner's future, which nothing else bounded: one never answered (a defect; likely
    the stall a CI run saw once, 2026-12-07, after the TC log's partition failed twice
    within a second) held the TC partition's appends, and so every commit gathered on
    it, for good and in silence. A late answer is dropped."""
    loop = asyncio.get_running_loop()
    bounded = loop.create_future()

    def overdue() -> None:
        if not bounded.done():
            future.add_done_callback(observe_failure)  # (nobody reads it now)
            bounded.set_exception(AtomlogError(
                "REQUEST_TIMED_OUT", f"the TC log's append in this process was not answered "
                f"within {timeout_s:g} s (its outcome is unknown)"))

    timer = loop.call_later(timeout_s, overdue)

    def answered(done: asyncio.Future) -> None:
        timer.cancel()
        if bounded.done():
            return
        if done.cancelled():
            bounded.cancel()
        elif done.exception() is not None:
            bounded.set_exception(done.exception())
        else:
            bounded.set_result(done.result())

    future.add_done_callback(answered)
    return bounded


def _count(append: Append) -> None:
    for record in append.records:
        kind = type(record)
        if kind is Opened:
            metrics.STARTED.inc()
        elif kind is Decided:
            decided = _DECIDED.get((record.decision, record.cause))
            if decided is None:
                decided = _DECIDED[record.decision, record.cause] = _decided_children(record)
            decided[0].inc()
            decided[1].inc(len(record.kept_children))
            decided[2].inc(len(record.aborted_children))
        elif kind is Completed:
            ended = _ENDED.get(record.decision)
            if ended is None:
                ended = _ENDED[record.decision] = metrics.ENDED.labels(
                    record.decision.name.lower())
            ended.inc()


# The children of _count's metrics by decision (and cause), each looked up once: two or
# three records a transaction come here.
_DECIDED: dict = {}
_ENDED: dict = {}


def _decided_children(record: Decided) -> tuple:
    cause = ("timeout" if record.cause in (EndCause.TIMEOUT, EndCause.PREPARED_TIMEOUT)
             else record.cause.name.lower())
    return (metrics.DECIDED.labels(record.decision.name.lower(), cause),
            metrics.DECIDED.labels("commit", "parent"), metrics.DECIDED.labels("abort", "parent"))
