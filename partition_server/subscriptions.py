"""Subscriptions of one partition: the shell around partition_server/cursor_store.py
(docs/subscriptions.md, "What the shell does").

Every change is decided and staged in one step on the event loop (no await between a
check and its stage, so the next check sees it), then made durable by a group commit:
one journal write + fsync (on a worker thread) for everything staged meanwhile, at most
one in flight. A request is answered only once the journal is durable past everything
staged when it was decided (no-ops included). A failed write or fsync breaks the store:
it is reopened from disk (what is durable) and the waiting requests fail retriably.

Snapshots never block the loop: when one is due after a group commit, the cursors are
encoded on the loop (`snapshot_begin`), the journal is rotated on a worker thread as part
of the same group commit (fsync up to the covered entry, new journal created and
fsynced), and the snapshot file is then written and obsolete files deleted by a
background task on a worker thread while group commits go on in the new journal. At most
one snapshot at a time. A failed step is a failed write: the store is reopened. File
work on worker threads and `open` hold one lock, so a reopen never races a snapshot.

On a replicated partition (the owner leads it: `replication()` returns its
LeaderReplication, partition_server/replica.py) the store is opened retaining what
followers copy, every change is first refused unless writes may be acknowledged
(NOT_ENOUGH_REPLICAS, fenced, the new leader's gate), and after the local fsync it is
answered only once the cursor high watermark over the in-sync replicas passes it
(docs/replication.md, "Cursors"). Unreplicated partitions are as before.

Long polls (Receive) wait for new data, for the earliest delivery deadline of the
cursors they read (`next_deadline_ms`), or for a wake-up: something became deliverable
before that deadline — an abort released pending acks, a Nack, a delivery with an
earlier deadline, an ack or commit on a cursor whose new deliveries had stopped at a
limit, retention on such a cursor, a reopened store.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from partition_server.cursor_store import CursorStore, CursorStoreLimits, SnapshotJob, StoreEntry
from partition_server.durability import LogSync
from partition_server.record_batch import TxnId, iter_batches
from partition_server.subscription_cursor import CursorDescription, Delivery, merge_ranges
from services.backoff import Backoff
from services.batching import resolve
from services.errors import AtomlogError
from services.logs import event

# A Receive's first read of a region, in bytes (a read returns at least one whole batch);
# later reads are sized by the bytes per offset seen so far and the messages still wanted.
RECEIVE_FIRST_READ_BYTES = 64 << 10

# A reopen of the journal after a failure that failed too: tried again after about this
# (services/backoff.py), doubling up to the maximum, while the partition's subscriptions
# answer PARTITION_LOADING.
REOPEN_RETRY_S = 0.2
REOPEN_RETRY_MAX_S = 5.0

log = logging.getLogger("atomlog.partition.subscriptions")


class _Wakeups:
    """Long polls waiting on this partition's subscriptions, woken per subscription name.
    A waiter remembers `serial` after its pass and waits only if its name was not woken
    since. Bounded: one future per name with a waiter, one integer per name woken (names
    of live subscriptions; a deleted name and a reopen forget theirs)."""

    def __init__(self) -> None:
        self.serial = 0  # wake-ups so far
        self._woken_at: dict[str, int] = {}  # name -> serial of its last wake-up
        self._floor = 0  # a name not in _woken_at was last woken at most here
        self._futures: dict[str, asyncio.Future] = {}

    def wake(self, name: str) -> None:
        self.serial += 1
        self._woken_at[name] = self.serial
        resolve(self._futures.pop(name, None))

    def forget(self, name: str) -> None:
        """The subscription is gone: wake its waiters and drop its entries."""
        self.wake(name)
        del self._woken_at[name]
        self._floor = self.serial

    def wake_all(self) -> None:
        self.serial += 1
        self._woken_at.clear()
        self._floor = self.serial
        futures, self._futures = self._futures, {}
        for future in futures.values():
            resolve(future)

    def woken_since(self, name: str, serial: int) -> bool:
        return self._woken_at.get(name, self._floor) > serial

    async def wait(self, name: str, serial: int, timeout_s: float) -> None:
        """Return once name is woken after serial, or after timeout_s."""
        if self.woken_since(name, serial) or timeout_s <= 0:
            return
        future = self._futures.get(name)
        if future is None:
            future = self._futures[name] = asyncio.get_running_loop().create_future()
        try:  # shielded: a waiter that times out leaves the shared future alone
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            return


class PartitionSubscriptions:
    def __init__(self, name: str, directory: Path, limits: CursorStoreLimits,
                 log_start: Callable[[], int], replication: Callable[[], object] = lambda: None,
                 durability: Callable[[Path], LogSync | None] = lambda directory: None):
        """`durability(directory)` (called on a worker thread as each store opens): the
        LogSync that makes the journal durable in the rounds of the process's durability
        barrier (partition_server/durability.py), with the partition's log; None: an
        fsync of its own on a worker thread."""
        self.name = name
        self._durability = durability
        self._log_sync: LogSync | None = None  # the open store's (taken at each open)
        self._replication = replication  # the leadership, or None (not replicated)
        self._log_start = log_start
        self.directory = directory
        self.limits = limits
        self.store: CursorStore | None = None
        self.error: AtomlogError | None = None  # DATA_LOSS of the journal: refuse
        self._syncing: asyncio.Future | None = None  # the group commit in flight
        self._snapshotting: asyncio.Future | None = None  # the snapshot file being written
        self._reopening: asyncio.Future | None = None  # a failed reopen, tried again
        self._files = threading.Lock()  # open() and snapshot steps on worker threads
        self._wakeups = _Wakeups()
        self._blocked: set[str] = set()  # the last Receive found new deliveries stopped
        # Bumped by close(): a reopen after a failure that finishes after a close (and
        # maybe the owner's own open) closes what it opened instead of installing it.
        self._generation = 0

    def open(self, log_start_offset: int, log_end_offset: int | None = None) -> None:
        """Blocking (recovery reads files): call on a worker thread. Waits for a snapshot
        step still running on a worker thread (the directory is then consistent).
        `log_end_offset` (the owner's load): cursors above it are cut back to it first
        (CursorStore.truncate_to), journaled and fsynced before anything is served."""
        self.store, self.error, self._log_sync = self._open_store(log_start_offset,
                                                                  log_end_offset)

    def _open_store(self, log_start_offset: int, log_end_offset: int | None = None
                    ) -> tuple[CursorStore | None, AtomlogError | None, LogSync | None]:
        """The store, or the error it refuses to open with; and its LogSync (taken anew
        with each open: after a failed syncfs, one taken before is refused durability)."""
        with self._files:
            store = None
            try:
                store = CursorStore.open(self.directory, self.limits,
                                         retain_frames=self._replication() is not None)
                store.forget_below(log_start_offset)
                if log_end_offset is not None:
                    self._truncate(store, log_end_offset)
            except AtomlogError as error:
                _close_quietly(store)
                event(log, "subscriptions refuse to serve", logging.ERROR,
                      partition=self.name, error=error.message)
                return None, error, None
            except BaseException:
                _close_quietly(store)
                raise
        try:
            return store, None, self._durability(self.directory)
        except BaseException:
            store.close()
            raise

    def _truncate(self, store: CursorStore, log_end_offset: int) -> None:
        """Cursors above the log's end are cut back to it, journaled and fsynced before
        anything is served. Only an accepted data loss leaves them there: acks are taken
        below the max read position, which is durable data."""
        cut = store.truncate_to(log_end_offset)
        if cut:
            event(log, "subscription cursors cut back to the log end", logging.WARNING,
                  partition=self.name, log_end=log_end_offset, count=len(cut),
                  subscriptions=",".join(cut[:20]))

    def close(self) -> None:
        """On the loop. A snapshot step still running finishes on its own (the store
        abandons what is left of it); open() waits for it."""
        self._generation += 1
        if self._reopening is not None:
            self._reopening.cancel()
        self._wakeups.wake_all()
        self._blocked.clear()
        if self.store is not None:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001 — closing after a failure
                pass

    def _usable(self) -> CursorStore:
        if self.store is None:
            raise self.error or AtomlogError("PARTITION_LOADING",
                                             f"subscriptions of {self.name} are loading")
        return self.store

    # ------------------------------------------------------------------ durability
    async def _durable(self) -> int:
        """Wait until everything staged so far is durable (group commit); returns the
        sequence it waited for."""
        store = self._usable()
        target = store.appended_end
        while store.durable_end < target:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync_once(store))
            await asyncio.shield(self._syncing)
            if self.store is not store:  # reopened meanwhile: what was staged may be lost
                raise AtomlogError("PARTITION_LOADING", f"subscriptions of {self.name} were "
                                   "reopened after a failure; retry", {"retry_after_ms": "200"})
        return target

    def _note_durable(self, store: CursorStore) -> None:
        """Tell the leadership (if any) how far the journal is durable here."""
        replication = self._replication()
        if replication is not None and self.store is store:
            replication.cursor_durable(store.durable_end)

    async def _sync_once(self, store: CursorStore) -> None:
        """One group commit, then, when one is due, the start of a snapshot: the cursors
        encoded here, the journal rotated on a worker thread (so durable_end reaches the
        covered entry), the snapshot file left to a background task."""
        try:
            ticket = store.sync_begin()
            if ticket is not None:
                sync = self._log_sync
                try:
                    if sync is None:
                        await asyncio.to_thread(store.fsync, ticket)
                    else:  # in the barrier's round, with the partitions' logs
                        try:
                            await sync.sync(ticket.fd)
                        except OSError as error:
                            store.fsync_failed(error)
                            raise
                finally:
                    store.sync_end(ticket)
                self._note_durable(store)
            if self._snapshotting is None and store.snapshot_due():
                job = store.snapshot_begin()
                if job is not None:
                    await self._rotate(store, job)
                    self._note_durable(store)
                    self._snapshotting = asyncio.ensure_future(
                        self._write_snapshot(store, job))
        except Exception as error:  # noqa: BLE001 — reopen from what is durable
            log.exception("subscription journal of %s failed; reopening", self.name)
            raise await self._recover(store, error) from None
        finally:
            self._syncing = None

    async def _rotate(self, store: CursorStore, job: SnapshotJob) -> None:
        try:
            await asyncio.to_thread(self._locked, store.rotate, job)
        except BaseException:
            store.rotate_end(job)
            store.snapshot_end(job)
            raise
        store.rotate_end(job)

    async def _write_snapshot(self, store: CursorStore, job: SnapshotJob) -> None:
        """Background: the snapshot file and the deletion of obsolete files, on a worker
        thread; group commits go on meanwhile. A failure reopens the store."""
        try:
            try:
                await asyncio.to_thread(self._locked, store.write_snapshot, job)
            finally:
                store.snapshot_end(job)
        except Exception as error:  # noqa: BLE001 — reopen from what is durable
            log.exception("subscription snapshot of %s failed; reopening", self.name)
            if self._syncing is not None:  # let its fsync return (it fails: store broken)
                await asyncio.wait([self._syncing])
            await self._recover(store, error)
        finally:
            self._snapshotting = None

    def _locked(self, step: Callable[[SnapshotJob], None], job: SnapshotJob) -> None:
        with self._files:
            step(job)

    async def _recover(self, store: CursorStore, error: Exception) -> AtomlogError:
        """The store failed: close it and reopen it from what is durable (once per store:
        the first caller does it). Returns the error for the requests that waited."""
        failure = AtomlogError("PARTITION_LOADING", f"subscriptions of {self.name} are "
                               f"recovering after a write failure: {error}",
                               {"retry_after_ms": "200"})
        if self.store is not store or store.closed:
            return failure  # reopened (or being reopened) already, or closed by the owner
        try:
            store.close(sync=False)
        except Exception:  # noqa: BLE001 — already broken
            pass
        self.store, self.error = None, failure
        self._blocked.clear()
        self._wakeups.wake_all()
        generation = self._generation
        try:
            await self._reopen(generation)
        except Exception as reopen_error:  # noqa: BLE001 — the disk still refuses
            # (ENOSPC or EIO again, creating the new journal.) Before, nothing tried
            # again: the partition's subscriptions answered PARTITION_LOADING until the
            # owner reloaded, which nothing else made it do. Now the reopen is tried
            # again in the background, backing off, until it opens or the owner closes.
            event(log, "subscriptions could not reopen; retrying", logging.ERROR,
                  partition=self.name, error=f"{type(reopen_error).__name__}: {reopen_error}")
            self._reopening = asyncio.ensure_future(self._reopen_retrying(generation))
        return failure

    async def _reopen(self, generation: int) -> None:
        """Open the store again from what is durable and install it, unless the owner
        closed (maybe reopened) meanwhile. Raises what the open raised."""
        reopened, error, sync = await asyncio.to_thread(self._open_store, self._log_start())
        if generation != self._generation:  # the owner closed (maybe reopened) meanwhile
            if reopened is not None:
                reopened.close()  # not installed: its files must not stay open
            return
        self.store, self.error, self._log_sync = reopened, error, sync  # what is durable
        if reopened is not None:
            # Retention or DeleteRecords may have moved the log start while it opened (its
            # forget_below found no store): else cursors below it read OFFSET_OUT_OF_RANGE.
            reopened.forget_below(self._log_start())
            self._note_durable(reopened)
        self._wakeups.wake_all()  # deliveries were volatile: everything is deliverable

    async def _reopen_retrying(self, generation: int) -> None:
        backoff = Backoff(initial_s=REOPEN_RETRY_S, maximum_s=REOPEN_RETRY_MAX_S)
        attempt = 0
        try:
            while generation == self._generation and self.store is None:
                attempt += 1
                await asyncio.sleep(backoff.delay(attempt))
                if generation != self._generation:
                    return
                try:
                    await self._reopen(generation)
                except Exception as error:  # noqa: BLE001 — logged at ERROR once, above
                    log.debug("subscriptions of %s still cannot reopen: %s", self.name, error)
                    continue
                event(log, "subscriptions reopened", partition=self.name)
                return
        finally:
            if self._reopening is asyncio.current_task():
                self._reopening = None

    async def change(self, decide: Callable[[CursorStore], object],
                     writes: bool = True) -> object:
        """Run `decide(store)` (checks, then stages; raises to change nothing) and answer
        its result once durable (replicated: once the in-sync replicas hold it too, and
        refused with NOT_ENOUGH_REPLICAS below min.insync.replicas). writes=False: a
        decision known to stage nothing (it still waits for what it saw to be held)."""
        return await self.change_now(decide, writes)

    def change_now(self, decide: Callable[[CursorStore], object],
                   writes: bool = True) -> Awaitable[object]:
        """`change`, with `decide` run now, in the caller's step (it raises here, having
        changed nothing): what the caller stages after it in the same step shares its
        durability round. The returned coroutine answers once it is durable; it must be
        awaited."""
        replication = self._replication()
        store = self._usable()
        if replication is not None and writes:
            replication.check_writable()  # NOT_ENOUGH_REPLICAS etc.: nothing staged
        return self._held(decide(store), replication, writes)

    async def _held(self, result, replication, writes: bool):
        target = await self._durable()
        if replication is not None:
            await replication.cursors_replicated(target, writes)
        return result


    # ------------------------------------------------------------------ operations
    async def create(self, name: str, position: int) -> tuple[bool, int]:
        """CreateSubscription at `position` (resolved and clamped by the caller): whether
        this call created it, and its cumulative end, once durable."""
        def decide(store: CursorStore) -> tuple[bool, int]:
            entry = store.plan_create(name, position)
            if entry is not None:
                store.stage(entry)
            return entry is not None, store.cursor(name).cumulative_end

        # Joining an existing subscription writes nothing: served with too few replicas.
        return await self.change(decide, writes=name not in self._usable().cursors())

    async def delete(self, name: str) -> None:
        def decide(store: CursorStore) -> None:
            store.stage(store.plan_delete(name))
            self._blocked.discard(name)
            self._wakeups.forget(name)  # a waiting Receive answers UNKNOWN_SUBSCRIPTION

        await self.change(decide)

    async def reset(self, name: str, position: int) -> int:
        """ResetSubscription to `position` (resolved and clamped by the caller): the new
        cumulative end once durable."""
        def decide(store: CursorStore) -> int:
            store.stage(StoreEntry(name, store.cursor(name).plan_reset(position)))
            self._blocked.discard(name)
            self._wakeups.wake(name)  # waiting Receives deliver from the new position
            return store.cursor(name).cumulative_end

        return await self.change(decide)

    async def ack(self, name: str, cumulative_end: int, ranges, txn: TxnId | None,
                  limit: int, check: Callable[[], None] | None = None) -> int:
        """An ack, plain or transactional (pending until `txn`'s marker): the cursor's
        cumulative end once durable. `check` runs first in the same step as the staging
        and raises to refuse (a staged ack's coordinator epoch: service.py)."""
        return await self.ack_now(name, cumulative_end, ranges, txn, limit, check)

    def ack_now(self, name: str, cumulative_end: int, ranges, txn: TxnId | None,
                limit: int, check: Callable[[], None] | None = None) -> Awaitable[int]:
        """`ack` with its change staged now, in the caller's step (change_now: it raises
        here, having changed nothing); await the result."""
        def decide(store: CursorStore) -> int:
            if check is not None:
                check()
            entry = store.cursor(name).check_ack(cumulative_end, ranges, txn, limit=limit)
            if entry is not None:
                store.stage(StoreEntry(name, entry))
                self._wake_if_blocked(name)  # an ack may make room for new deliveries
            # As of this change: a later one, staged while this waits, may not survive.
            return store.cursor(name).cumulative_end

        return self.change_now(decide)

    async def end_txn(self, name: str, txn: TxnId, committed: bool) -> bool:
        """A marker for one subscription: already_ended. A subscription that does not
        exist has nothing pending: success (the coordinator retries item errors)."""
        return await self.end_txn_now(name, txn, committed)

    def end_txn_now(self, name: str, txn: TxnId, committed: bool) -> Awaitable[bool]:
        """end_txn with its change staged now (change_now); await the result."""
        def decide(store: CursorStore) -> bool:
            if name not in store.cursors():
                return False
            plan = store.cursor(name).plan_end_txn(txn, committed)
            if plan.entry is not None:
                store.stage(StoreEntry(name, plan.entry))
                if committed:
                    self._wake_if_blocked(name)
                else:
                    self._wakeups.wake(name)  # released pending acks: redeliverable now
            return plan.already_ended

        return self.change_now(decide)

    def staged_ack_now(self, name: str, txn: TxnId) -> Awaitable[bool]:
        """ResolveStaged for an ack (a parallel commit's resolution): whether `txn` has an
        ack pending on cursor `name`, decided now, in the caller's step, after the fence it
        raised (a stage of an older coordinator epoch that comes later is refused in its
        own step), and answered once everything staged before is durable (and held by the
        in-sync replicas), as change_now answers. A transaction keeps its pending entry
        until its marker, even once retention acknowledged its offsets; and no marker is
        sent before a decision is logged, so an undecided transaction that staged an ack
        here is pending. No subscription: nothing is pending."""
        def decide(store: CursorStore) -> bool:
            return name in store.cursors() and store.cursor(name).is_pending(txn)

        return self.change_now(decide, writes=False)

    def cumulative_end(self, name: str) -> int:
        return self._usable().cursor(name).cumulative_end

    def describe(self, name: str, max_read_position: int, now_ms: int) -> CursorDescription:
        return self._usable().cursor(name).describe(max_read_position, now_ms)

    def pending_transactions(self, name: str) -> list[TxnId]:
        """The transactions with acks pending on cursor `name`."""
        return self._usable().cursor(name).pending_transactions()

    def names(self) -> list[str]:
        return sorted(self._usable().cursors()) if self.store is not None else []

    def nack(self, name: str, consumer_id: str, ranges, now_ms: int, delay_ms: int) -> int:
        count = self._usable().cursor(name).nack(consumer_id, ranges or None, now_ms, delay_ms)
        if count:
            self._wakeups.wake(name)  # redeliverable now, or at a new (maybe earlier) time
        return count

    def next_deadline_ms(self, name: str) -> int | None:
        """When the cursor's earliest delivery expires or Nack delay ends (wall-clock ms);
        None: nothing out, or no such cursor."""
        store = self.store
        if store is None or name not in store.cursors():
            return None
        return store.cursor(name).next_deadline_ms()

    def new_deliveries_stopped(self, name: str) -> bool:
        """The last Receive pass on `name` found new deliveries stopped at a limit
        (max_unacked_offsets, max_ranges): new data will not be delivered before an ack."""
        return name in self._blocked

    def wakeup_mark(self) -> int:
        """Remember it right after a Receive pass; pass it to wait_for_wakeup."""
        return self._wakeups.serial

    async def wait_for_wakeup(self, name: str, mark: int, timeout_s: float) -> None:
        """Return when something on cursor `name` may be deliverable before its next
        deadline (see the module doc) since `mark`, or after timeout_s."""
        await self._wakeups.wait(name, mark, timeout_s)

    def _wake_if_blocked(self, name: str) -> None:
        if name in self._blocked:
            self._blocked.discard(name)  # the next pass records it again if still so
            self._wakeups.wake(name)

    def receive(self, name: str, consumer_id: str, read, limit: int, now_ms: int,
                ack_timeout_ms: int, max_bytes: int, max_offsets: int
                ) -> tuple[bytes, Delivery]:
        """One Receive pass (synchronous: reads are synchronous). `read(offset,
        max_bytes)` returns (filtered batches, next offset) under the reader's isolation,
        below `limit`. Returns the batches overlapping what was delivered."""
        store = self._usable()
        cursor = store.cursor(name)
        plan = cursor.read_plan(now_ms, max_offsets)
        if plan.new_allowed:
            self._blocked.discard(name)
        else:
            self._blocked.add(name)  # bounded by the subscriptions
        earliest_ms = cursor.next_deadline_ms()
        scanned: list[tuple[int, int]] = []
        readable: list[tuple[int, int]] = []
        chunks: list[tuple[int, int, memoryview]] = []  # (first, next, batch)
        budget = max_bytes
        # Messages still wanted: the scan stops once it read as many as one delivery can
        # take (holes, then new offsets, lowest first, as next_delivery hands them out),
        # not at max_bytes: a poll of 100 messages used to read (and CRC-check) up to
        # max_bytes of the log each time, 8 MiB from the SDK.
        wanted = max_offsets

        def scan(start: int, end: int) -> None:
            nonlocal budget, wanted
            position, stop = start, min(end, limit)
            per_offset = 0.0  # bytes per offset read so far: sizes the next read
            while position < stop and budget > 0 and wanted > 0:
                step = max(RECEIVE_FIRST_READ_BYTES, int(wanted * per_offset * 1.25))
                asked = min(budget, step)
                data, next_offset = read(position, asked)
                if next_offset <= position:
                    break
                scanned.append((position, next_offset))
                view = memoryview(data)
                for at, header in iter_batches(view):
                    first = max(header.base_offset, position)
                    if header.last_offset >= first:
                        readable.append((first, header.last_offset + 1))
                        chunks.append((header.base_offset, header.last_offset + 1,
                                       view[at:at + header.size]))
                        wanted -= max(0, min(header.last_offset + 1, stop) - first)
                per_offset = len(data) / (next_offset - position)
                # A read that kept nothing (aborted data under read_committed, markers)
                # costs what it read: charged 1 byte, a long aborted run was scanned to
                # its end in one pass on the event loop (10,000 reads for 10 M offsets).
                # What it passed is in `scanned`, so the skip goes on at the next pass.
                budget -= len(data) if data else asked
                position = next_offset

        for hole in plan.redeliver:
            scan(hole.start, hole.end)
        if plan.new_allowed and plan.new_from < limit and budget > 0:
            scan(plan.new_from, limit)
        delivery = cursor.next_delivery(consumer_id, merge_ranges(readable), merge_ranges(scanned),
                                        now_ms, ack_timeout_ms, max_offsets)
        if delivery.skip is not None:
            store.stage(StoreEntry(name, delivery.skip))  # durable with the next commit
        if delivery.delivered and (earliest_ms is None or
                                   now_ms + ack_timeout_ms < earliest_ms):
            self._wakeups.wake(name)  # other long polls planned for a later deadline
        wanted = delivery.delivered
        # Holes and the new region may read the same batch twice: keep one, by base offset.
        overlapping = {first: batch for first, end, batch in chunks
                       if any(r.start < end and first < r.end for r in wanted)}
        return b"".join(overlapping[first] for first in sorted(overlapping)), delivery

    def forget_below(self, log_start_offset: int) -> None:
        if self.store is not None:
            self.store.forget_below(log_start_offset)
            for name in list(self._blocked):  # retention acknowledges: room again
                self._wake_if_blocked(name)


def _close_quietly(store: CursorStore | None) -> None:
    """A store that failed to open whole (closed without syncing what it staged)."""
    if store is not None:
        try:
            store.close(sync=False)
        except Exception:  # noqa: BLE001 — closing after a failure
            pass
