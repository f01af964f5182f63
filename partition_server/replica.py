"""Replication shells (docs/replication.md): what a partition server does for a replicated
partition, acting on the rules of replication.py.

- `LeaderReplication` rides on the leader's PartitionOwner for one leadership (one leader
  epoch). The owner fsyncs groups as always, then hands each durable flush here and
  answers its requests only once the high watermark (the smallest durable end over the
  in-sync replicas, `LeaderProgress`) passes it. It serves followers' `Replicate` calls
  (long polls that also report what each follower holds durably) with whole batches up
  to the leader's log end — appended, not necessarily fsynced yet, so the leader's fsync
  and the followers' copies run side by side. In exchange a leadership never resumes its
  epoch: a leader whose write or fsync fails, or that would lead again an epoch it led
  before (a restart), gives the epoch up in ZooKeeper (`resign`) before anything is
  served again, so records it lost that followers copied are cut by leader-epoch
  truncation like any other divergent tail. It keeps the ISR current
  in ZooKeeper by compare-and-set (shrinking followers that lag or whose server is gone,
  expanding caught-up ones), and fences itself when a compare-and-set finds a newer state.
  A leader that begins a leadership serves clients only once the ISR holds its whole log
  (the gate), so nothing only it holds is ever read.
  Subscription cursors ride on the same calls (docs/replication.md, "Cursors"): each
  Replicate also reports the follower's cursor-journal position and is answered with the
  durable journal frames after it (or the leader's cursor snapshot and the frames after
  that); a cursor change is answered once the cursor high watermark over the ISR
  (`CursorProgress`) passes its frame, and a follower joins the ISR only holding it.
- `Follower` copies its leader's log into its own PartitionLog (byte for byte at the
  leader's offsets), fsyncs, records the leader epochs it copied, and asks again from its
  new end; on divergence it cuts its log back by leader epoch (`truncation_step`). It
  copies the cursor journal into its own CursorStore in the partition directory the same
  way; following a new leadership, it first replaces its cursors with the leader's
  snapshot, so it never keeps cursor state the new leader does not have.

Neither decides who leads: the partition manager steers each replica to leader or follower
from the partition's state in ZooKeeper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
import weakref
from typing import Awaitable, Callable, Sequence

import grpc

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server import metrics as m
from partition_server.cursor_store import (CursorStore, CursorStoreLimits, install_snapshot)
from partition_server.leader_epochs import LeaderEpochFile
from partition_server.log import LogConfig, PartitionLog
from partition_server.partition_states import IsrMoved, StaleIncarnation, StaleState, Versioned
from partition_server.replicate_wire import (ReplicateAnswer, parse_answer, parse_many,
                                             serialize_answer, serialize_many)
from partition_server.record_batch import iter_batches
from partition_server.replication import (NO_EPOCH, NOT_SYNCED, CopyThrottle, CursorProgress,
                                          LeaderProgress, complete_reassignment,
                                          resumes_epoch, truncation_step)
from partition_server.copy_link import LINK_FALLBACKS, LinkClient, LinkUnavailable
from services import clock, errors, failpoints, local
from services.batching import resolve
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.partition.replica")
PARTITION_SERVICE = partition_pb2.DESCRIPTOR.services_by_name["PartitionService"].full_name

# A follower's restart is seen by each partition it follows here (16-50 of them in the
# chaos runs): the first one logs it at INFO, the others at DEBUG. Per process: the
# newest incarnation of each follower logged so far.
_RESTARTS_LOGGED: dict[str, int] = {}

ISR_CHECK_INTERVAL_S = 0.25
# How often a leader in DATA_LOSS asks again whether a live in-sync replica can lead.
HAND_OVER_RETRY_S = 1.0
FOLLOWER_RETRY_FIRST_S = 0.05
FOLLOWER_RETRY_MAX_S = 1.0
REPLICATE_MAX_BYTES = 4 << 20
# A follower still reporting a log start below the one it was told hears it again this
# long after (LeaderReplication._start_news).
START_RETELL_MS = 1_000
# One ReplicateMany answer: records and cursor state of all its partitions together (the
# first partition with anything to send may pass it by its own first batch or snapshot).
REPLICATE_MANY_MAX_BYTES = 8 << 20
# Partitions per ReplicateMany call.
REPLICATE_MANY_MAX_PARTITIONS = 4096
# Cursor frames per Replicate answer (a snapshot comes whole on top of them, and then
# without log records).
REPLICATE_CURSOR_MAX_BYTES = 1 << 20
# A cursor snapshot is sent in one answer: it must fit grpc.max_message_bytes (16 MiB by
# default) with room to spare. Typical snapshots are a few KiB (docs/subscriptions.md).
REPLICATE_SNAPSHOT_MAX_BYTES = 12 << 20


def _now_ms() -> int:
    """The leader's clock for followers' lag and the ISR's ticks, which live in this
    process's memory only: steady (services/clock.py), so a wall clock stepped back no
    longer kept a follower that stopped in the ISR (and every acknowledgement waiting)
    for as long as the step, nor one stepped forward dropped every follower at once."""
    return clock.steady_ms()


class LeaderReplication:
    """The leader's side of one leadership. Lives on the event loop; `owner` is the
    partition's PartitionOwner (set by it when attached)."""

    def __init__(self, topic: str, partition: int, me: str, known: Versioned,
                 replicas: list[str], min_insync: int, max_lag_ms: int, known_hw: int,
                 directory,
                 write_isr: Callable[[Versioned, list[str], dict[str, int]],
                                     Awaitable[Versioned]],
                 live: Callable[[], set[str]],
                 complete_reassignment: Callable[..., Awaitable[Versioned | None]] | None = None,
                 resign: Callable[[int], Awaitable[Versioned]] | None = None):
        state = known.state
        assert state.leader == me, (state, me)
        self.topic, self.partition, self.me = topic, partition, me
        self.name = f"{topic}-{partition}"
        self.known = known
        self.epoch = state.leader_epoch
        self.replicas = list(replicas)
        self.directory = directory
        self.epochs: LeaderEpochFile | None = None  # opened with the log (`loaded`)
        self.known_hw = known_hw
        self.progress = LeaderProgress(me, self.replicas, set(state.isr), min_insync,
                                       max_lag_ms, _now_ms())
        self.local_durable_end = 0
        self.log_end = 0  # whole batches appended (maybe not durable): followers copy these
        self.gate = 0  # clients are served once the high watermark reaches it
        self.epoch_start = 0
        self.fenced: str | None = None  # why this leadership ended (a newer state exists)
        # Why this leadership gives its epoch up (a write or fsync failed; or it would
        # resume an epoch led before): nothing is served or accepted from then on, and
        # once the log is reloaded `resign` writes epoch + 1, which fences it.
        self.failed: str | None = None
        self._resign = resign
        self._resign_task: asyncio.Task | None = None
        self._heir_only = False  # the task only hands over to an heir (`hand_over`)
        self.owner = None
        self._write_isr = write_isr
        self._live = live
        self._complete_reassignment = complete_reassignment
        self.target: list[str] | None = None  # a running reassignment's replica list
        # Its replicas that were not replicas before it (copies being made, not copies
        # lost: `under_replicated`); unknown to a leader that took over during it.
        self.adding: frozenset[str] = frozenset()
        self.throttle: CopyThrottle | None = None  # on its new replicas' copies
        # Each follower's last (fetch offset, last epoch, cursor sequence, log start): a
        # repeat needs no divergence check and moves no high watermark (`begin_replicate`).
        self._asked: dict[str, tuple[int, int, int, int]] = {}
        # Each follower's newest incarnation seen (docs/replication.md, "Incarnations"):
        # older ones are refused, and the positions recorded belong to this one.
        self._incarnations: dict[str, int] = {}
        # The log start each follower was last told, and when (ms): a move past it
        # (retention, DeleteRecords) is news even on an idle partition, so followers
        # delete too; so is a follower still reporting an older start START_RETELL_MS
        # after it was told (`_start_news`).
        self._told_start: dict[str, tuple[int, int]] = {}
        # Each follower's log start as its last fetch reported it: DeleteRecords waits
        # for the in-sync ones to reach the leader's new start (`followers_deleted`).
        self._starts: dict[str, int] = {}
        self._starts_moved = _Wakeup()
        self._data: asyncio.Future | None = None
        # Moves with everything that may give a follower something to copy or to hear
        # (an append, a durable flush, the cursors, the log start, the replicas, the end
        # of the leadership): a ReplicateSession skips a partition whose generation has
        # not moved since a call found nothing for it.
        self.generation = 0
        # The fetch sessions holding this partition as quiet (`ReplicateSession.stir`):
        # told when the generation moves, so they need not look at it in every call.
        self.watchers: set[ReplicateSession] = set()
        self._isr_task: asyncio.Task | None = None
        # A poke of the ISR task (it may come before the task runs), and what it waits on.
        self._isr_poked = False
        self._isr_waiter: asyncio.Future | None = None
        self._closing = False  # close() began: the ISR task ends at its next check
        self._isr_writing = False
        # Until when, with these servers live, the ISR cannot change (`isr_check_due`):
        # reset by whatever changes the ISR, the replicas or what followers showed.
        self._isr_steady_until = 0
        self._isr_steady_live: set[str] | None = None
        self.cursors = CursorProgress(me, self.replicas, _now_ms())
        self._cursors_moved = _Wakeup()  # cursor changes wait on it
        self._unsent_snapshots: dict[str, int] = {}  # replica -> covered, reported

    # ---------------------------------------------------------------- lifecycle
    def loaded(self, log_start: int, log_end: int) -> None:
        """The owner (re)loaded its log, from `log_start` to `log_end`, all of it on disk.
        On the first load the leadership begins there (its epoch starts at the log end);
        clients wait until the ISR holds everything up to it."""
        first = self.epochs is None
        if first:
            self.epochs = LeaderEpochFile(self.directory, log_start, log_end)
            if resumes_epoch(self.epochs.cache, self.epoch):
                # This replica led (or copied) this epoch before: a restart within its
                # ZooKeeper session, or a leadership reopened. Its log may have lost
                # records of the epoch that followers copied: never lead it again.
                self.give_up(f"it would resume leader epoch {self.epoch} (its leader-epoch "
                             f"file holds epoch {self.epochs.cache.latest_epoch()})")
            elif self.epochs.set_aside is not None:
                # Not knowing which epochs it led counts as having led this one.
                self.give_up(f"its leader-epoch file was unreadable (set aside as "
                             f"{self.epochs.set_aside.name}): it may have led epoch "
                             f"{self.epoch} before")
        else:
            # A reload within this leadership: after a failed write or fsync (given up
            # already), or a data-loss recovery; either may have cut the log back.
            self.give_up("its log was reloaded")
        self._asked.clear()
        if self.failed is None:
            self.epochs.assign(self.epoch, log_end)
            self.epoch_start = log_end
            self.progress.start(log_end, self.known_hw)
        elif not first or self._heir_only:
            # (A data-loss recovery mended the log: its epoch is given up as after any
            # reload, no longer only to an heir. Also when the first load found the
            # damage: it handed over before the leadership's epochs were set up.)
            if self._heir_only and self._resign_task is not None:
                self._resign_task.cancel()
                self._resign_task = None
            self.resign_soon()  # (a first load: `start` does, once the owner is open)
        self.local_durable_end = log_end
        self.log_end = log_end
        self.progress.leader_durable(log_end)
        self.gate = log_end
        store = self.owner.subscriptions.store if self.owner is not None else None
        if store is not None:
            self.cursors.leader_durable(store.durable_end)
        self._wake_followers()

    def start(self) -> None:
        if self.failed is not None:  # (a resumed epoch: given up before it serves)
            self.resign_soon()  # (not after hand_over: only an heir may lead then)
            return
        self._isr_task = asyncio.create_task(self._maintain_isr(), name=f"isr {self.name}")

    async def close(self) -> None:
        # The flag, not the cancellation alone, ends the ISR task: on Python 3.11,
        # asyncio.wait_for (which the task waited in until 2026-12-04, and which other
        # awaits of it may still use) swallows a cancellation that arrives as what it
        # waits on ends (an ISR change poked just before close): it went on forever.
        self._closing = True
        self._wake_isr()
        for task in (self._isr_task, self._resign_task):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.fence("the leadership ended")

    # ---------------------------------------------------------------- giving up the epoch
    def give_up(self, why: str) -> None:
        """From now on nothing is served or accepted in this leadership (clients and
        followers get NOT_PARTITION_OWNER); `resign_soon` then writes epoch + 1. Called by
        the owner when a write or fsync failed (before it cuts its log back to what it
        made durable), and when the leadership would resume an epoch led before."""
        if self.failed is None and self.fenced is None:
            self.failed = why
            event(log, "leader gives up its epoch", logging.WARNING, partition=self.name,
                  epoch=self.epoch, why=why)
        self._wake_followers()
        self._wake_cursor_waiters()
        self._wake_start_waiters()

    def resign_soon(self) -> None:
        """Write epoch + 1 (another live in-sync replica leads, or this one again; see
        replication.resign) in the background, retrying while ZooKeeper is away; the
        state's watch then steers this server to the new leadership or to following."""
        self._start_resigning(heir_only=False)

    def _start_resigning(self, heir_only: bool) -> None:
        if self._resign_task is None and self._resign is not None and self.fenced is None:
            self._heir_only = heir_only
            self._resign_task = asyncio.create_task(self._resign_epoch(heir_only),
                                                    name=f"resign {self.name}")

    async def _resign_epoch(self, heir_only: bool) -> None:
        delay = ISR_CHECK_INTERVAL_S
        while self.fenced is None:
            if heir_only:
                await failpoints.hold(failpoints.HAND_OVER_HOLD)
            try:
                stored = await self._resign(self.epoch, heir_only=heir_only)
            except StaleState:
                self.fence(f"gave up epoch {self.epoch}; another leadership began meanwhile")
                return
            except Exception as error:  # noqa: BLE001 — ZooKeeper away: try again
                event(log, "giving up the leader epoch not written; retrying", logging.WARNING,
                      partition=self.name, epoch=self.epoch,
                      error=f"{type(error).__name__}: {error}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, FOLLOWER_RETRY_MAX_S * 4)
                continue
            if stored is None:  # (heir_only: no other live replica of the ISR yet)
                await asyncio.sleep(HAND_OVER_RETRY_S)
                continue
            state = stored.state
            self.fence(f"gave up epoch {self.epoch} ({self.failed}): {state.leader} leads in "
                       f"epoch {state.leader_epoch}")
            return

    def hand_over(self, why: str) -> None:
        """The owner's log has corruption before its tail (it loaded in DATA_LOSS, or a
        read found it): this leadership serves nothing more (`give_up`), and as soon as
        another live replica of the ISR can lead, that one leads in epoch + 1 (it holds
        every acknowledged record intact) and this server follows it, its copy cut at the
        damage and the rest fetched (`Follower._open`). Until then (no other replica of the
        ISR is live, or the ISR is this one alone) the partition stays in DATA_LOSS here,
        for an operator (`atomlog partition recover`), asked again every second."""
        self.give_up(why)
        self._start_resigning(heir_only=True)

    @property
    def handing_over(self) -> bool:
        """`hand_over` runs and another replica of the ISR is live to take the partition,
        or it ran and the partition has another leader now: clients are told to look for
        the new leader rather than DATA_LOSS. (Once handed over, the owner answers so until
        it follows the new leader; before, that window answered DATA_LOSS, final for a
        client whose routes still named this server: a CI run of
        test_a_leader_handing_a_damaged_partition_over_sends_clients_on, 2026-12-05.)"""
        if self._resign_task is None or not self._heir_only:
            return False
        if self.fenced is not None:
            return True
        live = self._live()
        return any(r != self.me and r in live for r in self.progress.isr)

    def fence(self, why: str) -> None:
        if self.fenced is None:
            self.fenced = why
            event(log, "leadership ended", partition=self.name, epoch=self.epoch, why=why)
        self._wake_followers()
        self._wake_cursor_waiters()
        self._wake_start_waiters()

    def isr_changed(self, isr) -> None:
        """The ISR as stored now (by this leader or another writer: a server leaves the
        ISRs of its partitions when it starts): followers that left it rejoin only on log
        and cursor positions they report after leaving."""
        left = set(self.progress.isr) - set(isr)
        self._isr_steady_until = 0
        self.progress.isr_changed(isr)
        self._wake_start_waiters()  # a follower that left is no longer waited for
        self.cursors.left_isr(left)

    def reassigned(self, replicas: list[str], target: list[str] | None,
                   throttle: int = 0) -> None:
        """The topic record changed this partition's replicas (a reassignment began, was
        replaced or ended): new replicas may fetch — at most `throttle` bytes/s each while
        not in sync, when it is not 0 — and once every one of `target` is in sync this
        leader ends the reassignment (`_maintain_isr`)."""
        rate = throttle if target else 0
        if rate != (self.throttle.rate if self.throttle is not None else 0):
            self.throttle = CopyThrottle(rate) if rate else None
            self._wake_followers()  # a lifted or raised throttle: waiting copies may go
        if list(replicas) == self.replicas and target == self.target:
            return
        self._moved()
        self._isr_steady_until = 0
        now = _now_ms()
        self.adding = frozenset(r for r in target or () if r not in self.replicas
                                or r in self.adding)
        self.replicas = list(replicas)
        self.target = list(target) if target else None
        self.progress.replicas_changed(self.replicas, now)
        self.cursors.replicas_changed(self.replicas, self.progress.isr, now)
        self._poke_isr()

    def under_replicated(self) -> bool:
        """Fewer in-sync replicas than the partition has copies: a replica a running
        reassignment is adding and that has not caught up yet is a copy being made, not
        one lost, and does not count (as Kafka leaves adding replicas out; before, every
        reassignment longer than the alert's 5 minutes fired it)."""
        isr = self.progress.isr
        being_made = sum(1 for r in self.adding if r not in isr)
        return len(isr) < len(self.replicas) - being_made

    # ---------------------------------------------------------------- checks
    def check_serving(self) -> None:
        if self.fenced is not None or self.failed is not None:
            raise AtomlogError("NOT_PARTITION_OWNER",
                               f"{self.me} no longer leads {self.name} "
                               f"({self.fenced or 'gives up its epoch: ' + self.failed})",
                               {"owner": "", "retry_after_ms": "100"})
        if self.progress.high_watermark < self.gate:
            raise AtomlogError("PARTITION_LOADING",
                               f"new leader of {self.name} waits for its in-sync replicas to "
                               f"hold its log (high watermark {self.progress.high_watermark}, "
                               f"log end {self.gate})", {"retry_after_ms": "50"})

    def check_writable(self) -> None:
        self.check_serving()
        refusal = self.not_enough_replicas()
        if refusal is not None:
            raise refusal

    def not_enough_replicas(self) -> AtomlogError | None:
        """NOT_ENOUGH_REPLICAS while the ISR is below min.insync.replicas, else None."""
        if self.progress.may_acknowledge():
            return None
        isr = sorted(self.progress.isr)
        return AtomlogError("NOT_ENOUGH_REPLICAS",
                            f"{self.name} has {len(isr)} in-sync replicas {isr}; "
                            f"min.insync.replicas is {self.progress.min_insync}",
                            {"isr": ",".join(isr),
                             "min_insync_replicas": str(self.progress.min_insync)})

    # ---------------------------------------------------------------- the leader's writes
    def durable(self, end: int) -> None:
        """An fsync made the leader's log durable up to `end`."""
        if end > self.local_durable_end:
            self.local_durable_end = end
            self.progress.leader_durable(end)
            self._wake_followers()

    def appended(self, end: int) -> None:
        """The leader appended whole batches up to `end` (written, not yet durable):
        followers may copy them now, while the leader's fsync runs."""
        if end > self.log_end:
            self.log_end = end
            self._wake_followers()

    @property
    def high_watermark(self) -> int:
        return self.progress.high_watermark

    # ---------------------------------------------------------------- the leader's cursors
    def cursor_durable(self, end: int) -> None:
        """The leader's cursor journal is durable up to sequence `end` (after a group
        commit, a journal rotation, or a reopen of the store)."""
        if end > self.cursors.leader_durable_end:
            self.cursors.leader_durable(end)
            self._wake_followers()
            self._wake_cursor_waiters()

    @property
    def cursor_high_watermark(self) -> int:
        return self.cursors.high_watermark(self.progress.counted())

    async def cursors_replicated(self, target: int, writes: bool = True) -> None:
        """Return once every in-sync replica holds the cursor frames below `target`
        durably. NOT_PARTITION_OWNER when the leadership ends first (the change may or may
        not survive: the caller retries); for a change that wrote (`writes`),
        NOT_ENOUGH_REPLICAS when the ISR shrank below min.insync.replicas meanwhile
        (applied here, not acknowledged)."""
        await self.cursors_readable(lambda: target)
        if writes:
            try:
                self.check_writable()
            except AtomlogError as refused:
                if refused.reason != "NOT_ENOUGH_REPLICAS":
                    raise
                # Kafka's NOT_ENOUGH_REPLICAS_AFTER_APPEND: say it was applied.
                raise AtomlogError(
                    refused.reason, f"{refused.message}: the change was applied on "
                    "the leader before the ISR shrank and is not acknowledged (it "
                    "may survive; repeating it is safe)",
                    {**refused.metadata, "applied_on_leader": "true"}) from None

    async def cursors_readable(self, end: Callable[[], int],
                               deadline: float | None = None) -> None:
        """Return once every in-sync replica holds the cursor frames below `end()` as it
        is then. It is read again at every check, and the check that returns is the last
        step before the caller's, so a read of the cursors right after this never shows a
        change staged while it waited unreplicated (chaos run ctp 2548).
        NOT_ENOUGH_REPLICAS (retriable) past `deadline` (time.monotonic());
        NOT_PARTITION_OWNER when the leadership ends."""
        while True:
            if self.fenced is not None:
                raise AtomlogError("NOT_PARTITION_OWNER",
                                   f"{self.me} no longer leads {self.name} ({self.fenced})",
                                   {"owner": ""})
            if self.cursor_high_watermark >= end():
                return
            wait_s = ISR_CHECK_INTERVAL_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    raise AtomlogError("NOT_ENOUGH_REPLICAS",
                                       f"{self.name}: its in-sync replicas do not hold every "
                                       "cursor change yet; retry", {"retry_after_ms": "200"})
            # Woken when it may have moved; looked at again at the ISR's pace anyway.
            await self._cursors_moved.wait(wait_s)

    def _wake_cursor_waiters(self) -> None:
        self._cursors_moved.wake()

    # ---------------------------------------------------------------- DeleteRecords
    async def followers_deleted(self, start: int, deadline: float) -> list[str]:
        """Wait until every in-sync follower has reported a log start at or past `start`
        (the leader's new one after a DeleteRecords: Kafka's low watermark), so a follower
        elected next holds none of the deleted records; or until `deadline`
        (time.monotonic()). Returns the in-sync followers still behind then, [] once none
        is. A follower that leaves the ISR meanwhile is no longer waited for (it rejoins
        only by copying from the leader's start, below which it deletes first).
        NOT_PARTITION_OWNER when the leadership ends first."""
        while True:
            if self.fenced is not None or self.failed is not None:
                raise AtomlogError("NOT_PARTITION_OWNER",
                                   f"{self.me} no longer leads {self.name} "
                                   f"({self.fenced or self.failed})", {"owner": ""})
            starts = self._starts
            behind = sorted(replica for replica in self.progress.isr
                            if replica != self.me and starts.get(replica, -1) < start)
            wait_s = min(ISR_CHECK_INTERVAL_S, deadline - time.monotonic())
            if not behind or wait_s <= 0:
                return behind
            # Woken when a start moved or the ISR changed; looked at again anyway.
            await self._starts_moved.wait(wait_s)

    def _wake_start_waiters(self) -> None:
        self._starts_moved.wake()

    def _cursor_store(self) -> CursorStore | None:
        """The leader's cursor store when it can serve followers (loaded, retaining)."""
        store = self.owner.subscriptions.store if self.owner is not None else None
        if store is None or store.closed or not store.retains_frames:
            return None
        return store

    def _cursor_news(self, position: int) -> bool:
        """Whether a follower at cursor `position` has something to copy now."""
        store = self._cursor_store()
        if store is None:
            return False
        covered, size = store.replication_base
        if position < covered or position > store.durable_end:  # a snapshot to send
            return size <= REPLICATE_SNAPSHOT_MAX_BYTES
        return position < self.cursors.leader_durable_end

    def _add_cursors(self, response, position: int, replica: str) -> None:
        """The cursor part of a Replicate answer for a follower at `position`."""
        store = self._cursor_store()
        if store is None:
            return
        try:
            snapshot, first, frames = store.replication_read(position,
                                                             REPLICATE_CURSOR_MAX_BYTES)
        except AtomlogError:
            return  # the store broke: it is being reopened; the follower asks again
        if snapshot is not None and len(snapshot) > REPLICATE_SNAPSHOT_MAX_BYTES:
            # Fail closed: the follower cannot sync its cursors, so it leaves the ISR by
            # cursor lag (or never joins); its log goes on being copied. (Reported once
            # per follower and snapshot.)
            if self._unsent_snapshots.get(replica) != first:
                self._unsent_snapshots[replica] = first
                event(log, "cursor snapshot too large to replicate", logging.ERROR,
                      partition=self.name, replica=replica, snapshot_bytes=len(snapshot),
                      limit_bytes=REPLICATE_SNAPSHOT_MAX_BYTES)
            return
        response.cursors_available = True
        if snapshot is not None:
            response.cursor_snapshot = snapshot
        response.cursor_first_sequence = first
        response.cursor_frames = frames
        response.cursor_durable_end = store.durable_end

    def _wake_followers(self) -> None:
        self._moved()
        data, self._data = self._data, None
        resolve(data)

    def _moved(self) -> None:
        """Something a follower may copy or hear changed: the generation moves, and the
        fetch sessions that hold this partition as quiet look at it in their next call
        (or the one waiting now)."""
        self.generation += 1
        if self.watchers:
            watchers, self.watchers = self.watchers, set()
            for session in watchers:
                session.stir(self)

    async def _wait_for_data(self, offset: int, cursor_position: int,
                             timeout_s: float, replica: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not self.has_news(offset, cursor_position, replica):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self.log_end > offset:  # held back by the throttle: until it refills
                remaining = min(remaining, self.throttle_wait_s(replica))
            try:
                await asyncio.wait_for(asyncio.shield(self.data_future()), remaining)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- followers
    async def replicate(self, request, max_wait_s: float) -> ReplicateAnswer:
        """A follower's Replicate call (already validated: known partition, sane fields)."""
        begun = self.begin_replicate(request)
        if isinstance(begun, partition_pb2.ReplicateResponse):
            return ReplicateAnswer(begun)
        if not self.has_news(request.fetch_offset, begun, request.replica):
            await self._wait_for_data(request.fetch_offset, begun, max_wait_s, request.replica)
        return self.answer_replicate(request, begun, request.max_bytes or REPLICATE_MAX_BYTES)

    def begin_replicate(self, request) -> partition_pb2.ReplicateResponse | int:
        """The first half of a Replicate: check the follower's request and record what it
        holds (which may move the high watermarks and the ISR). Returns the answer when
        the follower's log left this leader's history (`diverging`), else the follower's
        cursor position for `has_news` and `answer_replicate`."""
        owner = self.owner
        self._check_epoch(request.leader_epoch)
        if request.replica == self.me or request.replica not in self.replicas:
            raise AtomlogError("NOT_A_REPLICA",
                               f"{request.replica!r} is not a follower of {self.name} "
                               f"(replicas {self.replicas})")
        self._check_incarnation(request.replica, request.replica_incarnation)
        partition_log = owner.log
        fetch = request.fetch_offset
        log_start = partition_log.log_start_offset
        if fetch < log_start:
            raise AtomlogError("OFFSET_OUT_OF_RANGE",
                               f"{request.replica} fetches {self.name} from {fetch}, below the "
                               f"leader's log start {log_start}",
                               {"log_start_offset": str(log_start),
                                "high_watermark": str(self.high_watermark)})
        # The same position as this replica's previous call (an idle partition in a
        # ReplicateMany): no divergence (this leadership's history only grows), and no
        # high watermark can have moved by it.
        asked = (fetch, request.last_fetched_epoch, request.cursor_sequence,
                 request.log_start_offset)
        repeat = self._asked.get(request.replica) == asked
        if not repeat:
            diverging = self._divergence(fetch, request.last_fetched_epoch)
            if diverging is not None:
                epoch, end = diverging
                return partition_pb2.ReplicateResponse(
                    high_watermark=self.high_watermark, log_start_offset=log_start,
                    log_end_offset=self.log_end, diverging=True,
                    diverging_epoch=epoch, diverging_end_offset=end)
        if fetch > self.log_end:
            raise AtomlogError("OFFSET_OUT_OF_RANGE",
                               f"{request.replica} fetches {self.name} from {fetch}, past the "
                               f"leader's log end {self.log_end}")
        now = _now_ms()
        self.progress.fetched(request.replica, fetch, self.log_end, now)
        cursor_position = self.cursors.fetched(request.replica, request.cursor_sequence, now)
        if not repeat:
            owner.replicated()  # the high watermark may have moved: answer what it covers
            self._wake_cursor_waiters()  # so may the cursors' one
            self._asked[request.replica] = asked
            if self._starts.get(request.replica) != request.log_start_offset:
                self._starts[request.replica] = request.log_start_offset
                self._wake_start_waiters()  # a DeleteRecords may wait for it
        if self.progress.expand(self.epoch_start) is not None or self.progress.lost:
            self._isr_steady_until = 0  # (the ticker looks, should this poke be dropped)
            self._poke_isr()
        return cursor_position

    def fetched_again(self, replica: str, fetch: int, cursor_sequence: int,
                      now_ms: int) -> int:
        """A repeat of `replica`'s previous fetch that a ReplicateSession skips (same
        request, same leadership, its generation unmoved): what `begin_replicate` records
        of a repeat — the follower's caught-up times, which keep it in the ISR — without
        the checks the session's conditions already stand for. Returns its cursor
        position. (A follower that may join the ISR is found by the IsrTicker.)"""
        self.progress.fetched(replica, fetch, self.log_end, now_ms)
        if self.progress.lost:
            self._isr_steady_until = 0
        return self.cursors.fetched(replica, cursor_sequence, now_ms)

    def _check_incarnation(self, replica: str, incarnation: int) -> None:
        """A fetch of an older process of `replica` than one seen is refused; the first
        fetch of a newer one makes this leader forget what the older one showed (its
        positions may be of a disk since wiped), whether or not the ISR change of its
        start or its gap in /servers was seen here."""
        seen = self._incarnations.get(replica)
        if seen is not None and incarnation < seen:
            raise AtomlogError("STALE_REPLICA_INCARNATION",
                               f"{replica} fetches {self.name} as incarnation {incarnation}; "
                               f"incarnation {seen} of it has fetched already")
        if seen is not None and incarnation > seen:
            first = incarnation > _RESTARTS_LOGGED.get(replica, 0)
            if first:
                _RESTARTS_LOGGED[replica] = incarnation
            event(log, "follower restarted", logging.INFO if first else logging.DEBUG,
                  partition=self.name, replica=replica, incarnation=incarnation,
                  previous=seen)
            self._forget_positions({replica})
        self._incarnations[replica] = incarnation

    def _forget_positions(self, replicas: set[str]) -> None:
        """Only fetches recorded from now on count for these followers (none is in the
        ISR, or leaving it: a forgotten in-sync follower holds the high watermark)."""
        self._moved()
        self._isr_steady_until = 0
        self.progress.forget(replicas)
        self.cursors.left_isr(replicas)
        for replica in replicas:
            self._asked.pop(replica, None)
            self._starts.pop(replica, None)
            self._told_start.pop(replica, None)  # (a restarted one holds another log)

    def has_news(self, fetch: int, cursor_position: int, replica: str = "") -> bool:
        """Whether `replica`, a follower at `fetch` and `cursor_position`, has something to
        copy now (records its throttle lets through, cursor state) or must hear that this
        leadership ended; or that the log start moved (it deletes below it too)."""
        return ((self.log_end > fetch and self.throttle_wait_s(replica) == 0)
                or self.fenced is not None or self.failed is not None
                or self._cursor_news(cursor_position) or self._start_news(replica))

    def _start_news(self, replica: str) -> bool:
        """Whether `replica` must hear this leader's log start: it moved past what the
        follower was last told, or the follower still reports an older start
        START_RETELL_MS after it was told. An answer built is not an answer applied: the
        call may break on the way, ReplicateMany may leave it out, the follower's copy
        may fail; and once the partition is idle no records come to carry the start
        again, so the follower kept the deleted segments and, elected, served them
        again (a CI run of the wipe and reassign nemeses). A follower whose segments
        cannot end exactly there is told again at that pace, no faster."""
        partition_log = self.owner.log if self.owner is not None else None
        if partition_log is None:
            return False
        start = partition_log.log_start_offset
        told = self._told_start.get(replica)
        if told is None or start > told[0]:
            return True
        return (self._starts.get(replica, start) < start
                and _now_ms() - told[1] >= START_RETELL_MS)

    def _throttled(self, replica: str) -> bool:
        """A new replica of a throttled reassignment, not in sync yet."""
        return (self.throttle is not None and self.target is not None
                and replica in self.target and replica not in self.progress.isr)

    def throttle_wait_s(self, replica: str) -> float:
        """Seconds until `replica` may be sent records again (0: now, or unthrottled)."""
        if not self._throttled(replica):
            return 0.0
        return self.throttle.wait_s(replica, time.monotonic())

    def data_future(self) -> asyncio.Future:
        """Resolved at this leader's next append, durable flush or end of leadership (for
        a wait over many partitions: `replicate_many`)."""
        if self._data is None:
            self._data = asyncio.get_running_loop().create_future()
        return self._data

    def check_answerable(self, epoch: int) -> None:
        """This leadership still serves a follower of `epoch` (it may have ended, or
        its owner may be reloading its log, since the call began)."""
        self._check_epoch(epoch)
        self.owner.check_loaded()

    def answer_replicate(self, request, cursor_position: int,
                         max_bytes: int) -> ReplicateAnswer:
        """The second half of a Replicate: whole batches from the follower's fetch offset
        up to `max_bytes` (the first whole even when larger; fewer for a throttled new
        replica) and the cursor journal's news. Checks again that this leadership still
        serves. The records stay as read from the log, beside the message
        (replicate_wire: they are spliced into the wire bytes, never copied into it)."""
        # The owner may have reloaded its log meanwhile (after a failed write).
        self.check_answerable(request.leader_epoch)
        partition_log = self.owner.log
        fetch = request.fetch_offset
        cursors = partition_pb2.ReplicateResponse()
        self._add_cursors(cursors, cursor_position, request.replica)
        records, next_offset = b"", fetch
        # Up to the log end: whole batches this leader appended, fsynced or not (the log
        # end moves only once a group's writev completed; a failed write breaks the log,
        # and this read then fails). The high watermark still waits for the leader's own
        # fsync (`durable`), and a leader whose fsync fails gives this epoch up.
        end = min(self.log_end, partition_log.log_end_offset)
        throttled = self._throttled(request.replica)
        if throttled:
            max_bytes = min(max_bytes, self.throttle.allowance(request.replica,
                                                               time.monotonic()))
        if fetch < end and not cursors.cursor_snapshot and max_bytes > 0:
            # (A cursor snapshot travels alone: the message stays within its bound.)
            records, next_offset = partition_log.read(
                fetch, min(max_bytes, REPLICATE_MAX_BYTES), upper_bound_offset=end)
            if throttled:
                self.throttle.spent(request.replica, len(records), time.monotonic())
        entries = self.epochs.cache.entries
        epochs = [partition_pb2.LeaderEpochEntry(epoch=e, start_offset=s)
                  for i, (e, s) in enumerate(entries)
                  if s < max(next_offset, fetch + 1)
                  and (i + 1 == len(entries) or entries[i + 1][1] > fetch)]
        self._told_start[request.replica] = (partition_log.log_start_offset, _now_ms())
        response = partition_pb2.ReplicateResponse(
            high_watermark=self.high_watermark,
            log_start_offset=partition_log.log_start_offset,
            log_end_offset=self.log_end, epochs=epochs,
            # The follower starts its segments where this log's start, so retention and
            # DeleteRecords (whole segments) leave every replica the same records.
            segment_bases=partition_log.segment_bases(fetch, next_offset) if records else ())
        response.MergeFrom(cursors)
        return ReplicateAnswer(response, records)

    def _check_epoch(self, epoch: int) -> None:
        if self.fenced is not None or self.failed is not None:
            raise AtomlogError("NOT_PARTITION_OWNER", f"{self.me} no longer leads {self.name}",
                               {"owner": ""})
        if epoch > self.epoch:
            # The caller names a newer leadership than this one. A real newer epoch reaches
            # this server through ZooKeeper's watch (and fences it then); the caller's word
            # alone changes nothing here (it may be wrong, or forged), as in Kafka.
            raise AtomlogError("NOT_PARTITION_OWNER",
                               f"{self.name}: leader epoch {epoch} is newer than this "
                               f"leadership's ({self.epoch}) on {self.me}",
                               {"owner": ""})
        if epoch < self.epoch:
            raise AtomlogError("FENCED_LEADER_EPOCH",
                               f"{self.name} is in leader epoch {self.epoch}, not {epoch}",
                               {"leader_epoch": str(self.epoch)})

    def log_start_moved(self, log_start: int) -> None:
        """The owner's retention or DeleteRecords moved this leader's log start: the epoch
        covering it now begins there, in memory (the file follows at the next load, which
        truncates it from the log start likewise). Else a follower restarted at the log
        start, holding no epoch, was told its log left this one's below that start, cut
        below its own start, restarted there again, and so on without end (chaos seed
        2690)."""
        self._moved()  # news for every follower: it deletes below it too
        if self.epochs is not None:
            self.epochs.cache.truncate_from_start(log_start)

    def _divergence(self, fetch: int, last_epoch: int) -> tuple[int, int] | None:
        """None when a follower whose log ends at `fetch` with records of `last_epoch` last
        holds a prefix of this log; else (the epoch to report, where it ends here)."""
        epoch, end = self.epochs.cache.end_offset_for(last_epoch, self.log_end)
        if epoch == last_epoch and fetch <= end:
            return None
        return epoch, end

    # ---------------------------------------------------------------- the ISR
    def _poke_isr(self) -> None:
        if self._isr_task is not None and not self._isr_writing:
            self._wake_isr()

    def _wake_isr(self) -> None:
        self._isr_poked = True
        resolve(self._isr_waiter)

    async def _maintain_isr(self) -> None:
        loop = asyncio.get_running_loop()
        ticker = IsrTicker.of(loop)
        ticker.add(self)
        try:
            await self._isr_rounds(loop)
        except Exception as error:  # noqa: BLE001 — a defect: fail closed, not silently
            # ZooKeeper's and the followers' faults are handled in the rounds; anything
            # else escaping them is a defect. Left alone, the task would end and this
            # leadership would go on serving with an ISR that never changes again: a
            # follower that stopped would hold every acknowledgement (min.insync) or
            # none would move the high watermark for ever. So the epoch is given up, as
            # after a failed write, and another in-sync replica (or this one, in a new
            # epoch with a new ISR task) leads.
            event(log, "ISR task failed; giving up the epoch", logging.ERROR,
                  partition=self.name, epoch=self.epoch,
                  error=f"{type(error).__name__}: {error}")
            self.give_up(f"its ISR task failed ({type(error).__name__}: {error})")
            self.resign_soon()
        finally:
            ticker.discard(self)

    async def _isr_rounds(self, loop: asyncio.AbstractEventLoop) -> None:
        while self.fenced is None and self.failed is None and not self._closing:
            if not self._isr_poked:
                # Until poked: by a fetch that may let a follower join, a replica change,
                # close, or this event loop's IsrTicker when a check would change the ISR
                # (no timer per partition: an idle server with thousands of them would
                # wake each four times a second).
                waiter = self._isr_waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._isr_waiter = None
            self._isr_poked = False
            if self._closing:
                return
            if self.failed is not None:
                return  # giving the epoch up: no more ISR changes in it
            wanted = self._wanted_isr()
            if wanted is None:
                if self.target is not None and await self._end_reassignment():
                    return
                continue
            joining = {r: self._incarnations.get(r, 0) for r in wanted - self.progress.isr}
            self._isr_writing = True
            self.progress.joining = set(joining)
            try:
                stored = await self._write_isr(self.known, sorted(wanted), joining)
            except StaleState:
                self.fence("its partition state changed in ZooKeeper")
                return
            except StaleIncarnation as stale:
                # Fetches of a process that has been replaced (or, with 0, of none yet):
                # forgotten; only its newest incarnation's fetches count from now on.
                event(log, "replicas not added to the ISR: a newer process of theirs "
                      "exists", logging.WARNING, partition=self.name,
                      replicas=sorted(stale.current), latest=stale.current)
                for replica, latest in stale.current.items():
                    self._incarnations[replica] = max(self._incarnations.get(replica, 0),
                                                      latest)
                self._forget_positions(set(stale.current))
                continue
            except Exception as error:  # noqa: BLE001 — ZooKeeper away: try again
                event(log, "ISR change not written; retrying", logging.WARNING,
                      partition=self.name, error=f"{type(error).__name__}: {error}")
                await asyncio.sleep(ISR_CHECK_INTERVAL_S)
                continue
            finally:
                self._isr_writing = False
                self.progress.joining = set()
            before = set(self.progress.isr)
            self.known = stored
            self.isr_changed(stored.state.isr)
            after = set(stored.state.isr)
            if after < before:
                m.ISR_SHRINKS.inc()
            elif after > before:
                m.ISR_EXPANDS.inc()
            event(log, "ISR changed", partition=self.name, epoch=self.epoch,
                  isr=sorted(after), left=sorted(before - after), joined=sorted(after - before))
            if self.owner is not None:
                self.owner.replicated()
            self._wake_cursor_waiters()

    async def _end_reassignment(self) -> bool:
        """Once every target replica is in sync: the topic record's replicas become the
        target and the state keeps only them in its ISR (a new leader among them, in a
        new epoch, when this one is left out) — one ZooKeeper transaction. Returns True
        when this leadership ended by it."""
        if self._complete_reassignment is None:
            return False
        final = complete_reassignment(self.known.state, self.target, self._live())
        if final is None:
            return False
        target = list(self.target)
        self._isr_writing = True
        try:
            stored = await self._complete_reassignment(self.known, target, final)
        except IsrMoved as moved:  # (only the ISR: this leadership goes on from it)
            self.known = moved.fresh
            self.isr_changed(moved.fresh.state.isr)
            return False
        except StaleState:
            self.fence("its partition state changed in ZooKeeper")
            return True
        except Exception as error:  # noqa: BLE001 — ZooKeeper away: try again
            event(log, "reassignment not completed; retrying", logging.WARNING,
                  partition=self.name, error=f"{type(error).__name__}: {error}")
            await asyncio.sleep(ISR_CHECK_INTERVAL_S)
            return False
        finally:
            self._isr_writing = False
        if stored is None:
            return False  # another target replaced it: the record's watch tells us
        event(log, "reassignment completed", partition=self.name, replicas=target,
              leader=final.leader, epoch=final.leader_epoch, isr=list(final.isr))
        if final.leader != self.me:
            self.fence(f"handed leadership to {final.leader} (reassigned)")
            return True
        self.known = stored
        self.isr_changed(final.isr)
        self.reassigned(target, None)
        if self.owner is not None:
            self.owner.replicated()
        return False

    def isr_check_due(self, now_ms: int, live: set[str]) -> bool:
        """Whether the waiting ISR task has work (IsrTicker): the ISR would change, or a
        reassignment may end. With every replica in sync, nothing but time (a follower's
        lag) and the live servers can change it: until the earliest time a follower could
        lag (`_isr_steady_until`, from caught-up times, which only grow) and while the same
        servers are live, the answer is no without looking at the followers."""
        if self._isr_waiter is None or self._isr_writing:
            return False  # running (it checks itself before it waits again), or writing
        if self.target is not None:
            return True
        if now_ms < self._isr_steady_until and live == self._isr_steady_live:
            return False
        return self._wanted_isr(now_ms, live) is not None

    def _wanted_isr(self, now_ms: int | None = None,
                    live: set[str] | None = None) -> set[str] | None:
        """The ISR this leader should store: without followers that lag or whose server
        is gone from ZooKeeper, with live ones that caught up; None when unchanged."""
        progress = self.progress
        live = self._live() if live is None else live
        isr = progress.isr
        now = _now_ms() if now_ms is None else now_ms
        followers = progress.followers
        store = self._cursor_store()
        if len(isr) == len(followers) + 1:
            # Every replica in sync (the common case): only a follower that lags or left
            # can change the ISR, and not before `_isr_steady_until` unless one leaves.
            max_lag, cursor_caught_up = progress.max_lag_ms, self.cursors.caught_up_ms
            oldest = now
            for replica in isr:
                if replica == self.me:
                    continue
                caught_up = followers[replica].caught_up_ms
                cursors_caught_up = cursor_caught_up.get(replica, now)
                if (replica not in live or now - caught_up > max_lag or replica in progress.lost
                        or (store is not None and now - cursors_caught_up > max_lag)):
                    break
                oldest = min(oldest, caught_up, cursors_caught_up)
            else:
                self._isr_steady_until, self._isr_steady_live = oldest + max_lag + 1, live
                return None
        isr = set(isr)
        keep = {r for r in (progress.shrink(now) or isr) if r == self.me or r in live}
        # (Only followers that fetched: their positions are of the incarnation named.)
        joining = {r for r in (progress.expand(self.epoch_start) or isr) - isr
                   if r in live and r in self._incarnations}
        if store is not None:
            # An in-sync replica must keep up with the cursor journal too, and hold every
            # acknowledged cursor change when it joins.
            keep -= self.cursors.lagging(isr, now, progress.max_lag_ms)
            joining = {r for r in joining if self.cursors.holds(r, isr)}
        elif self.owner is not None:
            joining = set()  # the store reopens (or refuses): whether a joiner holds every
            # acknowledged cursor change cannot be told, so none joins meanwhile
        wanted = keep | joining
        return wanted if wanted != isr else None

    def status(self, into: partition_pb2.ReplicationStatus) -> None:
        """DescribePartition's view of the replicas (`atomlog partition describe`)."""
        progress, now = self.progress, _now_ms()
        into.leader_epoch = self.epoch
        into.replicas.extend(self.replicas)
        into.isr.extend(r for r in self.replicas if r in progress.isr)
        into.replicated_high_watermark = self.high_watermark
        lag = progress.lag()
        for replica in self.replicas:
            follower = progress.followers.get(replica)
            if replica == self.me or follower is None:
                continue
            into.followers.add(replica=replica, in_sync=replica in progress.isr,
                               durable_end_offset=follower.durable_end,
                               lag_offsets=lag.get(replica, 0),
                               caught_up_ms_ago=max(0, now - follower.caught_up_ms))
        into.reassigning_to.extend(self.target or ())
        if self.target and self.throttle is not None:
            into.reassignment_throttle_bytes_per_s = self.throttle.rate


class IsrTicker:
    """One timer per event loop for the ISR checks of every leadership on it: each
    ISR_CHECK_INTERVAL_S it asks each waiting ISR task's leadership whether its ISR
    would change (`isr_check_due`, a few microseconds when every replica is in sync)
    and wakes only those. Replaces a timer and a task wake-up per led partition four
    times a second, which made an idle server's CPU grow with its partitions
    (docs/replication.md, "Idle cost")."""

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IsrTicker]" = \
        weakref.WeakKeyDictionary()

    def __init__(self, interval_s: float = ISR_CHECK_INTERVAL_S) -> None:
        # (No reference to its loop: the loop is the key it is kept under, weakly.)
        self.interval_s = interval_s
        self._leaders: dict[LeaderReplication, None] = {}  # in the order they began
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "IsrTicker":
        ticker = cls._of_loop.get(loop)
        if ticker is None:
            ticker = cls._of_loop[loop] = cls()
        return ticker

    def __len__(self) -> int:
        return len(self._leaders)

    def add(self, leader: LeaderReplication) -> None:
        self._leaders[leader] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def discard(self, leader: LeaderReplication) -> None:
        self._leaders.pop(leader, None)
        if not self._leaders and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        now = _now_ms()
        lives: dict[Callable[[], set[str]], set[str]] = {}  # each source asked once a tick
        try:
            for leader in list(self._leaders):
                try:
                    source = leader._live
                    live = lives.get(source)
                    if live is None:
                        live = lives[source] = source()
                    due = leader.isr_check_due(now, live)
                except Exception:  # noqa: BLE001 — its task checks (and logs) for itself
                    due = True
                if due:
                    leader._wake_isr()
        finally:
            # Armed again whatever happened above: else no leader of this loop would
            # have its ISR checked on time again until a new one registered.
            if self._leaders:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s,
                                                                    self._tick)


# A partition a ReplicateSession skips is looked at in full again after this long at
# most (and after half its replication.max_lag_ms). What a fetch records with its time
# (the follower caught up) does not wait for it: a skipped repeat records that too
# (`LeaderReplication.fetched_again`); the full look is a safety net.
SESSION_RECHECK_MS = 5_000
# ... and has its repeat recorded at most this often (a busy leader's calls come every few
# milliseconds: recording each would cost every quiet partition in every call again).
SESSION_RECORD_MS = 200
SESSION_MAX_PARTITIONS = 2 * REPLICATE_MANY_MAX_PARTITIONS
# A fetch session's last epoch: its follower then opens a new one.
SESSION_EPOCH_MAX = 0x7FFFFFFF


class ReplicateSession:
    """One follower server's ReplicateMany calls on this leader server (docs/replication.md,
    "Quiet partitions" and "Fetch sessions").

    Quiet partitions: for each partition, what a call asked (fetch offset, last epoch,
    cursor sequence, leader epoch, incarnation) when the call found nothing to send it,
    the leader's `generation` then, the cursor position `begin_replicate` gave and when.
    A later call asking the same of the same leadership, its generation unmoved, finds
    the same (nothing) and records nothing new: `replicate_many` skips it, so a call
    costs the partitions that changed, not every partition the follower copies: a skipped
    one only has its repeat recorded (the follower's caught-up times, which keep it in
    the ISR), at most every SESSION_RECORD_MS. Each is looked at in full again after
    SESSION_RECHECK_MS (or half its max_lag_ms).

    The fetch session on the wire (KIP-227): every partition the follower asks for, as it
    last named it (`asked`), so an incremental call names only what changed. A call looks
    at the partitions it names, the `active` ones (not quiet after the last call) and the
    `stirred` ones (quiet, but their leader moved since: `LeaderReplication.watchers`).
    The quiet rest costs nothing per call: their repeats are recorded, and their full
    looks come due, in a sweep every SESSION_RECORD_MS (`working`)."""

    __slots__ = ("quiet", "id", "epoch", "asked", "active", "stirred", "swept_ms", "_stir")

    def __init__(self) -> None:
        # (topic, partition) -> (leader, asked, generation, cursor position, when looked
        # at in full, when its repeat was last recorded; in ms)
        self.quiet: dict[tuple[str, int], tuple] = {}
        self.id = 0  # the open fetch session's id (0: none)
        self.epoch = 0  # its last call's epoch
        self.asked: dict[tuple[str, int], partition_pb2.ReplicateRequest] = {}
        self.active: set[tuple[str, int]] = set()
        self.stirred: set[tuple[str, int]] = set()
        self.swept_ms = 0
        self._stir: asyncio.Future | None = None  # a waiting call wakes on it

    @staticmethod
    def _asked(request) -> tuple:
        return (request.fetch_offset, request.last_fetched_epoch, request.cursor_sequence,
                request.leader_epoch, request.replica_incarnation, request.log_start_offset)

    def skip(self, leader: "LeaderReplication", request, now_ms: int) -> int | None:
        """For a partition this call may skip, its repeat recorded and the follower's
        cursor position; else None."""
        tp = request.topic_partition
        key = (tp.topic, tp.partition)
        entry = self.quiet.get(key)
        if entry is None:
            return None
        known, asked, generation, position, when_ms, recorded_ms = entry
        if (known is not leader or generation != leader.generation
                or now_ms - when_ms >= min(SESSION_RECHECK_MS, leader.progress.max_lag_ms // 2)
                or leader.throttle is not None or asked != self._asked(request)):
            return None
        if now_ms - recorded_ms < SESSION_RECORD_MS:
            return position  # recorded moments ago: the follower's caught-up time is fresh
        try:
            position = leader.fetched_again(request.replica, request.fetch_offset,
                                            request.cursor_sequence, now_ms)
        except AtomlogError:
            return None  # (looked at in full: its checks say why)
        self.quiet[key] = (known, asked, generation, position, when_ms, now_ms)
        return position

    def found(self, leader: "LeaderReplication", request, generation: int, position: int,
              news: bool, now_ms: int) -> None:
        """What a call found for a partition it looked at: nothing to send (as of the
        leader's `generation` before it looked), or news (forgotten: looked at again)."""
        tp = request.topic_partition
        key = (tp.topic, tp.partition)
        if news:
            self.quiet.pop(key, None)
            return
        if key not in self.quiet and len(self.quiet) >= SESSION_MAX_PARTITIONS:
            # (partitions that moved away: recorded again as they come; those of the open
            # fetch session stay, or no call would look at them again)
            self.quiet = {k: v for k, v in self.quiet.items() if k in self.asked}
        self.quiet[key] = (leader, self._asked(request), generation, position, now_ms, now_ms)
        if generation == leader.generation:
            leader.watchers.add(self)
        else:  # moved while it was looked at: the next call looks again
            self.stirred.add(key)

    # ------------------------------------------------------------- the fetch session
    def open(self, named: dict, now_ms: int | None = None) -> int:
        """A full request opened a new session of the partitions `named` (this call looks
        at each: the next sweep is due in SESSION_RECORD_MS); its id."""
        self.id = secrets.randbits(63) or 1
        self.epoch = 1
        self.asked = named
        self.active = set(named)
        self.stirred.clear()
        self.swept_ms = _now_ms() if now_ms is None else now_ms
        return self.id

    def advance(self, session_id: int, epoch: int, named: dict, forgotten: list) -> None:
        """An incremental call: checked whole (REPLICATE_SESSION_INVALID for another
        session or epoch, INVALID_ARGUMENT for a forgotten partition it does not hold or
        also names, or a session grown past REPLICATE_MANY_MAX_PARTITIONS), then applied."""
        if not self.id or session_id != self.id or epoch != self.epoch + 1:
            held = f"session {self.id}, epoch {self.epoch}" if self.id else "no session"
            self.id = 0  # (a follower out of step opens a new one)
            raise AtomlogError("REPLICATE_SESSION_INVALID",
                               f"session {session_id}, epoch {epoch}: this leader holds "
                               f"{held} for the follower",
                               {"session_id": str(session_id)})
        asked = self.asked
        for key in forgotten:
            if key not in asked or key in named:
                raise AtomlogError("INVALID_ARGUMENT",
                                   f"{key[0]}-{key[1]} is forgotten but "
                                   + ("named too" if key in named else "not in the session"))
        size = len(asked) - len(forgotten) + sum(1 for key in named if key not in asked)
        if size > REPLICATE_MANY_MAX_PARTITIONS:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"the session would hold {size} partitions; at most "
                               f"{REPLICATE_MANY_MAX_PARTITIONS}")
        for key in forgotten:
            del asked[key]
            self.active.discard(key)
            self.stirred.discard(key)
            self.quiet.pop(key, None)
        asked.update(named)
        self.epoch = epoch

    def working(self, named, now_ms: int | None = None) -> list:
        """The keys an incremental call looks at: those it names, the active ones, the
        stirred ones, and (every SESSION_RECORD_MS) the quiet ones `skip` would not skip;
        the other quiet ones have their repeat recorded here, by `skip`."""
        now_ms = _now_ms() if now_ms is None else now_ms
        keys = set(named)
        keys.update(self.active)
        keys.update(key for key in self.stirred if key in self.asked)  # (quiet may hold
        self.stirred.clear()  # partitions of no session: before it opened, or without one)
        if now_ms - self.swept_ms >= SESSION_RECORD_MS:
            self.swept_ms = now_ms
            for key, entry in list(self.quiet.items()):
                request = self.asked.get(key)
                if request is not None and key not in keys and \
                        self.skip(entry[0], request, now_ms) is None:
                    keys.add(key)
        return list(keys)

    def settle(self, looked, answered) -> None:
        """After a call looked at `looked` and answered `answered` (records, cursor state,
        a divergence or an error): those not quiet now are looked at in every call until
        they are."""
        quiet = self.quiet
        for key in answered:
            quiet.pop(key, None)
        self.active = {key for key in looked if key not in quiet and key in self.asked}

    def stir(self, leader: "LeaderReplication") -> None:
        """`leader` moved (`LeaderReplication._moved`): if its partition is quiet here, the
        next call (or the one waiting now) looks at it."""
        key = (leader.topic, leader.partition)
        entry = self.quiet.get(key)
        if entry is None or entry[0] is not leader:
            return
        self.stirred.add(key)
        waiter, self._stir = self._stir, None
        resolve(waiter)

    def take_stirred(self) -> list:
        """The keys stirred since the call took them last (a waiting call looks at them)."""
        keys = list(self.stirred)
        self.stirred.clear()
        return keys

    def stir_future(self) -> asyncio.Future:
        """What a waiting call of the session wakes on: resolved at the next stir, or at
        once while stirred partitions wait to be taken (stirred while the call was not
        waiting yet)."""
        if self._stir is None or self._stir.done():
            self._stir = asyncio.get_running_loop().create_future()
        if self.stirred:
            self._stir.set_result(None)
        return self._stir


async def replicate_many(items: list, max_wait_s: float, max_bytes: int,
                         rotation: int = 0, session: ReplicateSession | None = None,
                         more: Callable[[], list] | None = None) -> list:
    """One follower's ReplicateMany on this leader (docs/replication.md, "One call per
    leader"). `items`: (LeaderReplication, its already validated ReplicateRequest) per
    partition, or (AtomlogError, request) for a partition this server cannot serve.
    Returns a ReplicateAnswer or an AtomlogError per item, in order, or None for a
    partition with nothing to send (no records, cursor state, divergence or error: it is
    left out of the answer, and its follower simply asks again). With the follower's
    `session`, a partition whose request and leader are as they were when a call found
    nothing for it is not looked at, unless its leader wakes during the wait. With `more`
    (a fetch session's call), the wait also ends when a quiet partition of the session
    that this call does not look at is stirred: `more()` gives those partitions' items,
    which `items` (and the returned list) are extended with.

    Every partition's request is recorded first (what the follower holds durably moves
    high watermarks whether or not anything is copied); the call then waits, up to
    `max_wait_s`, only while no partition has anything to copy or to report. The answer
    stays within `max_bytes` of records and cursor state, beginning at `rotation` among
    the partitions so that a busy one cannot starve the others: the first partition with
    something to send gets its whole first batch (or cursor snapshot) even past the
    bound; one that no longer fits is left out, and asks again in the next call."""
    results: list = [None] * len(items)
    begun: dict[int, int] = {}
    skipped: set[int] = set()  # quiet in the session: looked at only if woken
    now_ms = _now_ms()

    def begin(index: int) -> None:
        leader, request = items[index]
        if isinstance(leader, AtomlogError):
            results[index] = leader
            return
        if session is not None:
            position = session.skip(leader, request, now_ms)
            if position is not None:
                begun[index] = position
                skipped.add(index)
                return
        try:
            outcome = leader.begin_replicate(request)
        except AtomlogError as error:
            results[index] = error
            return
        if isinstance(outcome, partition_pb2.ReplicateResponse):
            results[index] = ReplicateAnswer(outcome)  # diverging: the follower cuts first
        else:
            begun[index] = outcome

    for index in range(len(items)):
        begin(index)

    def news(indexes) -> bool:
        return any(items[i][0].has_news(items[i][1].fetch_offset, begun[i], items[i][1].replica)
                   for i in indexes)

    def refill_s() -> float:
        """Until a throttled partition's records may go (inf: none held back)."""
        return min((items[i][0].throttle_wait_s(items[i][1].replica) for i in begun
                    if items[i][0].log_end > items[i][1].fetch_offset), default=float("inf"))

    if (begun or more is not None) and len(begun) == len(items) and \
            not news(i for i in begun if i not in skipped):
        deadline = time.monotonic() + max_wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            woken: dict[asyncio.Future, list[int]] = {}
            for i in begun:
                woken.setdefault(items[i][0].data_future(), []).append(i)
            stirred = session.stir_future() if more is not None else None
            if stirred is not None:
                woken.setdefault(stirred, [])
            if not woken:
                break  # (a replaced session's call with nothing of its own to wait for)
            refill = refill_s()
            done, _pending = await asyncio.wait(woken, timeout=min(remaining, refill),
                                                return_when=asyncio.FIRST_COMPLETED)
            # Only the partitions whose leader woke can have news (a wake may also be a
            # durable flush with nothing new to copy: then wait on), or one whose
            # throttle refilled, or one of the session's quiet ones, stirred.
            awake = [i for future in done for i in woken[future]]
            fresh = more() if stirred is not None and stirred.done() else []
            if fresh is None:
                more = None  # (the session went on without this call: no more stirs)
            else:
                for request_item in fresh:
                    index = len(items)
                    items.append(request_item)
                    results.append(None)
                    begin(index)
                    awake.append(index)
                if len(begun) < len(items):
                    break  # an error or a divergence to answer
            skipped.difference_update(awake)
            if news(awake) or (refill != float("inf") and news(begun)):
                break
    budget, sent = max_bytes, False
    order = sorted(begun)
    if order:
        start = rotation % len(order)
        order = order[start:] + order[:start]
    for index in order:
        if index in skipped:
            continue  # quiet, and not woken: nothing to send
        leader, request = items[index]
        generation = leader.generation
        if not leader.has_news(request.fetch_offset, begun[index], request.replica):
            if session is not None:
                session.found(leader, request, generation, begun[index], False, now_ms)
            continue  # nothing to send (or held back by a throttle): left out
        if session is not None:
            session.found(leader, request, generation, begun[index], True, now_ms)
        own = request.max_bytes or REPLICATE_MAX_BYTES
        try:
            if sent and budget <= 0:
                continue  # no room left: it asks again
            response = leader.answer_replicate(request, begun[index],
                                               min(own, budget) if sent else own)
            size = (len(response.records) + len(response.cursor_snapshot)
                    + len(response.cursor_frames))
            if sent and size > budget:  # a whole first batch or snapshot too large
                continue
            budget -= size
            sent = sent or size > 0
        except AtomlogError as error:
            results[index] = error
            continue
        results[index] = response
    return results


class CursorCopyFailed(Exception):
    """A follower could not copy its leader's cursors (it starts over from the leader's
    snapshot); its log is not at fault."""


class Follower:
    """One replica copying its leader's log (one leader, one epoch: the manager replaces it
    when the partition's state changes)."""

    def __init__(self, topic: str, partition: int, directory, log_config: LogConfig, me: str,
                 leader: str, leader_address: str, epoch: int, fetcher: "LeaderFetcher",
                 fsync: bool = True, cursor_limits: CursorStoreLimits | None = None,
                 known_hw: int = 0, incarnation: int = 0, direct_io: bool = True):
        """`known_hw`: the high watermark this replica learned from its previous leader
        (everything below was acknowledged): a truncation below it means acknowledged
        records are lost (an unclean election), and is reported as such. `direct_io`:
        write the copies around the page cache (partition_server/direct_io.py)."""
        self.topic, self.partition = topic, partition
        self.name = f"{topic}-{partition}"
        self.key = (topic, partition)
        self.directory = directory
        self.log_config = log_config
        self.me = me
        self.leader = leader
        self.leader_address = leader_address
        self.epoch = epoch
        self.fetcher = fetcher
        self.fsync = fsync
        self.direct_io = direct_io
        self.log: PartitionLog | None = None
        self.epochs: LeaderEpochFile | None = None
        self.known_hw = known_hw
        self.incarnation = incarnation  # this server process's (every fetch names it)
        self.last_error = ""
        self._failing = ""  # the kind of the failures logged last ("" since a success)
        self.retry_at = 0.0  # time.monotonic(): asks again from then (after a failure)
        self._delay = FOLLOWER_RETRY_FIRST_S
        self._reopen_due = False
        self._damage: tuple | None = None  # (damage_found)
        # close() began: nothing may (re)open the log or copy cursors any more.
        self._closing = False
        # The cursor store, once this leader's snapshot is installed (None: not synced
        # with this leadership; the store on disk is left as it is until then). Used on
        # worker threads under the lock, so close() never races a copy in flight.
        self.cursor_limits = cursor_limits or CursorStoreLimits()
        self.cursors: CursorStore | None = None
        self._cursor_lock = threading.Lock()
        self._last_request: tuple | None = None  # (its fields, the request) built last

    @property
    def cursor_position(self) -> int:
        """What Replicate reports: every cursor frame below it is durable here."""
        store = self.cursors
        return store.durable_end if store is not None else NOT_SYNCED

    async def start(self) -> None:
        self.log, self.epochs = await asyncio.to_thread(self._open)
        self.known_hw = min(self.known_hw, self.log.log_end_offset)
        self.fetcher.add(self)
        event(log, "following", partition=self.name, leader=self.leader, epoch=self.epoch,
              log_end=self.log.log_end_offset,
              clean_shutdown=self.log.recovery.clean_shutdown,
              torn_bytes_truncated=self.log.recovery.truncated_bytes)

    def _open(self) -> tuple[PartitionLog, LeaderEpochFile]:
        partition_log = PartitionLog(self.directory, self.log_config,
                                     direct_copies=self.direct_io)
        loss = partition_log.data_loss
        if loss is not None:
            # A corrupt copy (a leader that found it handed the partition over, or it was
            # found at a load): cut at the damage, as an operator's recovery does, and
            # fetch the rest from the leader; leader-epoch truncation then reconciles
            # what is left, as after any leader change. Only if that finds more damage
            # is the copy worth nothing: wiped, and fetched whole.
            try:
                recovery = partition_log.recover_data_loss(loss.path, loss.offset)
                cut = recovery.data_loss is None
            except Exception as error:  # noqa: BLE001 — unreadable: start over
                log.warning("cutting the corrupt copy of %s failed: %s", self.name, error)
                cut = False
            event(log, "follower log corrupt; cut at the damage, fetching the rest" if cut
                  else "follower log corrupt; refetching it whole from the leader",
                  logging.WARNING, partition=self.name, offset=loss.offset)
            if not cut:
                try:
                    partition_log.close()
                except Exception:  # noqa: BLE001 — its files go next
                    pass
                _wipe_log(self.directory)
                partition_log = PartitionLog(self.directory, self.log_config,
                                             direct_copies=self.direct_io)
        epochs = LeaderEpochFile(self.directory, partition_log.log_start_offset,
                                 partition_log.log_end_offset)
        return partition_log, epochs

    async def close(self) -> None:
        # First: a reopen under way in the fetcher's round (prepare) closes what it opened
        # instead of keeping it (the log would stay open with nobody to close it), and a
        # cursor copy not yet begun does not begin.
        self._closing = True
        await self.fetcher.remove(self)  # once no copy of this follower is under way
        await asyncio.to_thread(self._close_cursors)
        if self.log is not None:
            await asyncio.to_thread(self.log.close)
            self.log = None

    @property
    def log_end(self) -> int:
        return self.log.log_end_offset if self.log is not None else 0

    # ---------------------------------------------------------------- the fetcher's calls
    def damage_found(self, partition_log, segment_base_offset: int, position: int,
                     offset: int, detail: str, cut_generation: int) -> None:
        """The scrubber found a damaged batch in this follower's copy (`partition_log`, if
        still its log): the fetcher's next round records it in the log (DATA_LOSS) and
        reopens it, which cuts the copy at the damage and fetches the rest (`_open`).
        Recorded there, on the event loop between rounds, not here: the link's thread may
        be copying into the log now."""
        self._damage = (partition_log, segment_base_offset, position, offset, detail,
                        cut_generation)
        self._reopen_due = True
        self.retry_at = 0.0
        self.fetcher.wake()

    async def prepare(self) -> partition_pb2.ReplicateRequest | None:
        """This partition's part of the fetcher's next ReplicateMany, or None while it
        cannot ask (its log failed to reopen: it backs off and tries again)."""
        if self._closing:
            return None
        damage, self._damage = self._damage, None
        if damage is not None and damage[0] is self.log:
            self.log.report_corruption(*damage[1:])  # (unless cut since it was read)
        if self._reopen_due or self.log is None:
            self._reopen_due = False
            await self._reopen()
            if self.log is None:
                self._back_off()
                return None
        return self.request()

    def request(self) -> partition_pb2.ReplicateRequest:
        """This partition's part of the next ReplicateMany, from its log as it is (its log
        is open: `prepare` checked, or the link's thread is copying). The same message as
        the last call's while nothing in it moved (most partitions of a call are quiet;
        callers copy it into their request, never change it)."""
        partition_log = self.log
        fields = (self.epoch, partition_log.log_end_offset, self.epochs.cache.latest_epoch(),
                  self.cursor_position, self.incarnation, partition_log.log_start_offset)
        last = self._last_request
        if last is not None and last[0] == fields:
            return last[1]
        request = partition_pb2.ReplicateRequest(
            replica=self.me, leader_epoch=fields[0], fetch_offset=fields[1],
            last_fetched_epoch=fields[2], max_bytes=REPLICATE_MAX_BYTES,
            cursor_sequence=fields[3], replica_incarnation=fields[4],
            log_start_offset=fields[5])
        request.topic_partition.topic = self.topic
        request.topic_partition.partition = self.partition
        self._last_request = (fields, request)
        return request

    async def handle(self, request, outcome) -> None:
        """Act on this partition's answer (a ReplicateAnswer, or a ReplicateResponse: both
        read the same) or failure (an exception:
        its item's error, or the whole call's); a failure backs this partition off."""
        restart = None
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            await self._copy(request.fetch_offset, outcome)
            self._delay = FOLLOWER_RETRY_FIRST_S
            self.last_error = self._failing = ""
        except asyncio.CancelledError:
            raise
        except AtomlogError as error:
            self.last_error = f"{error.reason}: {error}"
            self._note_failing(error.reason, error.message)
            if error.reason == "OFFSET_OUT_OF_RANGE" and \
                    "log_start_offset" in error.metadata and self.log is not None and \
                    self.log.log_end_offset < int(error.metadata["log_start_offset"]):
                restart = int(error.metadata["log_start_offset"])
            else:
                self._back_off()
                if error.reason in ("INTERNAL", "DATA_LOSS") and \
                        not getattr(error, "said_by_leader", False):
                    # A failed write or fsync left this log refusing. (Not the leader's
                    # answer: its damaged copy says nothing of this one, which a reopen
                    # every back-off would only scan again.)
                    self._reopen_due = True
        except Exception as error:  # noqa: BLE001 — leader away, disk trouble: retry
            self._failed(error)
        if restart is not None:
            # (Out of the handler above, so that its failure is handled as any other.)
            try:
                await self._restart_at(restart)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 — disk trouble: retry
                self._failed(error)
                self._reopen_due = True  # a restart cut short leaves the log unknown

    def _failed(self, error: Exception) -> None:
        """A fetch or its copy failed by an exception (leader away, disk trouble): back off,
        and reopen the log when the failure may have been this log's own."""
        self.last_error = f"{type(error).__name__}: {error}"
        self._note_failing(type(error).__name__, str(error))
        self._back_off()
        if isinstance(error, OSError) and not getattr(error, "said_by_leader", False):
            self._reopen_due = True

    def _note_failing(self, kind: str, detail: str) -> None:
        """Log a failure of this follower's fetches when its kind (an error's reason, or
        an exception's type) differs from the last one logged since a fetch went well:
        a follower that keeps failing says why once, not at every retry, and one that
        stops copying for good leaves its reason in its server's log."""
        if kind != self._failing:
            self._failing = kind
            event(log, "follower's fetches failing; retrying", partition=self.name,
                  leader=self.leader, epoch=self.epoch, reason=kind, detail=detail)

    def quiet(self) -> None:
        """The leader had nothing new for this partition: the call went well."""
        self._delay = FOLLOWER_RETRY_FIRST_S
        self.last_error = self._failing = ""

    def _back_off(self) -> None:
        self.retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, FOLLOWER_RETRY_MAX_S)

    async def _reopen(self) -> None:
        """After a failed write or fsync the log refuses every use until reopened: reopen it
        (recovery cuts a torn tail; a full disk keeps failing, and this keeps trying)."""
        if self.log is not None:
            closing, self.log = self.log, None
            try:
                await asyncio.to_thread(closing.close)
            except Exception:  # noqa: BLE001 — recovery decides what is on disk
                log.exception("closing the failed log of %s", self.name)
        try:
            opened, epochs = await asyncio.to_thread(self._open)
        except Exception as error:  # noqa: BLE001 — the disk may come back: the loop retries
            self.last_error = f"reopen failed: {type(error).__name__}: {error}"
            return
        if self._closing:  # closed meanwhile: the next owner of the directory opens it
            await asyncio.to_thread(opened.close)
            return
        self.log, self.epochs = opened, epochs
        event(log, "follower reopened its log after a failure", logging.WARNING,
              partition=self.name, log_end=self.log.log_end_offset)

    async def _copy(self, fetch: int, response) -> None:
        partition_log = self.log
        if partition_log.log_end_offset != fetch:
            return  # the log moved meanwhile (a restart at the leader's start): ask again
        if response.diverging:
            epoch, end = int(response.diverging_epoch), int(response.diverging_end_offset)
            if epoch == NO_EPOCH:
                # The leader keeps no epoch as old as this log's latest: what it keeps is
                # of later epochs (or unlabelled), so nothing here is known to be in its
                # history. A cut would leave this log's own epochs below it, and the
                # same question would be asked every round: start again, empty, at the
                # leader's log start, and copy from there.
                await self._truncate(min(fetch, end), response, restart=True)
                return
            # The next round asks about the latest epoch the cut leaves, which is the
            # one truncation_step names to ask about next.
            cut, _ = truncation_step(self.epochs.cache, fetch, epoch, end)
            await self._truncate(cut, response)
            return
        self.known_hw = response.high_watermark
        data = response.records  # once: see _copy_log
        # (The log start is checked here, in memory: most answers carry one that deletes
        # nothing, and an answer without records then needs no thread.)
        if data or self._log_start_moved(response):
            await asyncio.to_thread(self._copy_log, fetch, response, data)
        if _carries_cursors(response):
            await asyncio.to_thread(self._copy_cursors, response)

    def copies_in_place(self, request, response) -> bool:
        """Whether the link's thread may copy this answer itself (`copy_in_place`): records,
        leader epochs, the log start and cursor state, the plain case. Not a divergence
        (a truncation), or a follower closing or with its log to reopen: those go to the
        event loop (`handle`)."""
        return (not self._closing and not self._reopen_due and self.log is not None
                and self.log.log_end_offset == request.fetch_offset
                and not response.diverging)

    def copy_in_place(self, request, response) -> None:
        """On the link's thread: what `handle` does with an answer `copies_in_place`
        allows, without the event loop. Raises what the copy raised (the caller hands
        it to `handle`, which backs off, and reopens the log as after any failed copy
        unless only the cursors failed)."""
        self.known_hw = response.high_watermark
        self._copy_log(request.fetch_offset, response, response.records)
        if _carries_cursors(response):
            self._copy_cursors(response)
        self.quiet()

    def _log_start_moved(self, response) -> bool:
        partition_log = self.log
        before = min(int(response.log_start_offset), partition_log.high_watermark)
        return partition_log.log_start_after_delete(before) > partition_log.log_start_offset

    def _copy_log(self, fetch: int, response, data) -> None:
        """On a worker thread (or the link's): the answer's records `data` (checked,
        appended, fsynced), the leader epochs they begin, and the leader's log start.
        `data` is `response.records` read once by the caller: from a ReplicateResponse
        each read copies the field out of the message (from a ReplicateAnswer it is a
        slice of the received buffer)."""
        partition_log = self.log
        if data:
            self._append(data, response.segment_bases)
            end = partition_log.log_end_offset
            for entry in response.epochs:
                start = max(entry.start_offset, fetch)
                if start < end and entry.epoch > self.epochs.cache.latest_epoch():
                    self.epochs.assign(entry.epoch, start)
            m.REPLICA_FETCHED_BYTES.inc(len(data))
        if self._log_start_moved(response):
            self._follow_log_start(min(int(response.log_start_offset),
                                       partition_log.high_watermark),
                                   int(response.log_start_offset))

    def _append(self, data: bytes, segment_bases: Sequence[int]) -> None:
        """On a worker thread, off the event loop: check the copied batches (each whole,
        its CRC: the leader checked them when it read them, this checks the copy that
        arrived; 0.1 ms per MB), append them at the leader's offsets, starting segments
        where the leader's start (`segment_bases`; empty: a leader that does not say, and
        the log rolls by its own rules), fsync."""
        view = memoryview(data)
        self.log.append_copied([(view[position:position + header.size], header)
                                for position, header in iter_batches(view, verify=True)],
                               segment_bases=list(segment_bases) or None)
        if self.fsync:
            self.log.flush()
        else:
            target, _fd = self.log.flush_begin()
            self.log.flush_end(target, durable=False)

    def _follow_log_start(self, before: int, leader_start: int) -> None:
        """The leader's retention or DeleteRecords moved its log start: delete the whole
        segments below `before` here too (its start, or what this log holds durably if
        less), so a follower's disk is bounded as its leader's is. A follower applies no
        retention of its own: the leader's keeps what open transactions and snapshots
        still need."""
        partition_log = self.log
        partition_log.delete_records(before)
        self.epochs.truncate_from_start(partition_log.log_start_offset)
        event(log, "follower deleted segments below its leader's log start",
              partition=self.name, log_start=partition_log.log_start_offset,
              leader_log_start=leader_start)

    def _copy_cursors(self, response) -> None:
        """On a worker thread (or the link's), after the log's copy: install the leader's
        cursor snapshot when it sent one, then append its frames and fsync. Any failure
        drops the store (the next Replicate says NOT_SYNCED and the leader sends its
        snapshot again) and raises CursorCopyFailed: the caller backs off, but it is not
        the log's failure (no reopen of the log for it)."""
        with self._cursor_lock:
            if self._closing:
                return
            directory = self.directory / "cursors"
            try:
                if response.cursor_snapshot:
                    self._drop_cursors()
                    covered = install_snapshot(directory, response.cursor_snapshot,
                                               self.cursor_limits)
                    self.cursors = CursorStore.open(directory, self.cursor_limits)
                    event(log, "follower took its leader's cursor snapshot",
                          partition=self.name, leader=self.leader, epoch=self.epoch,
                          covered=covered, subscriptions=len(self.cursors.cursors()))
                store = self.cursors
                if store is None or not response.cursor_frames:
                    return
                if response.cursor_first_sequence != store.appended_end:
                    raise CursorCopyFailed(f"cursor frames of {self.name} from "
                                           f"{response.cursor_first_sequence}, expected from "
                                           f"{store.appended_end}")
                store.append_copied(response.cursor_frames)
                store.sync()
                store.maybe_snapshot()
            except BaseException as error:
                self._drop_cursors()
                if isinstance(error, Exception) and not isinstance(error, CursorCopyFailed):
                    raise CursorCopyFailed(f"{type(error).__name__}: {error}") from error
                raise

    def _drop_cursors(self) -> None:
        store, self.cursors = self.cursors, None
        if store is not None:
            try:
                store.close(sync=False)
            except Exception:  # noqa: BLE001 — already broken
                pass

    def _close_cursors(self) -> None:
        with self._cursor_lock:  # (_closing is set: no copy starts after this one)
            store, self.cursors = self.cursors, None
            if store is not None:
                try:
                    store.close()
                except Exception:  # noqa: BLE001 — what is durable stays; logged
                    log.exception("closing the cursor store of %s", self.name)

    async def _truncate(self, cut: int, response, restart: bool = False) -> None:
        """Cut this log back to `cut` (its leader's history ends there); with `restart`
        (or a cut below this log's start), start it again, empty, at the leader's log
        start instead."""
        partition_log = self.log
        if cut < partition_log.log_start_offset:
            await self._restart_at(max(response.log_start_offset, 0))
            return
        event(log, "follower truncates to its leader's history", partition=self.name,
              leader=self.leader, epoch=self.epoch, log_end=partition_log.log_end_offset,
              truncate_to=cut)
        lost = min(self.known_hw, partition_log.log_end_offset) - cut
        if lost > 0:  # below the old high watermark: only after an unclean election
            m.REPLICA_ACKNOWLEDGED_LOST.inc(lost)
            event(log, "acknowledged records lost: a replica without them leads (unclean "
                  "election)", logging.ERROR, partition=self.name, leader=self.leader,
                  epoch=self.epoch, first_lost_offset=cut, offsets_lost=lost)
        self.known_hw = min(self.known_hw, cut)
        if restart:
            await self._restart_at(max(response.log_start_offset, 0))
            return
        await asyncio.to_thread(partition_log.truncate_to, cut)
        # The batch containing `cut` goes whole: the log may end below it.
        await asyncio.to_thread(self.epochs.truncate_from_end, partition_log.log_end_offset)

    async def _restart_at(self, offset: int) -> None:
        event(log, "follower restarts its log at the leader's log start", partition=self.name,
              leader=self.leader, offset=offset)
        await asyncio.to_thread(self.log.restart_at, offset)
        await asyncio.to_thread(self.epochs.clear)


class _Wakeup:
    """A wake-up that any number of waiters share: `wait` returns once `wake` is called
    or after `timeout_s`, whichever comes first."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future | None = None

    async def wait(self, timeout_s: float) -> None:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._future), timeout_s)
        except asyncio.TimeoutError:
            pass

    def wake(self) -> None:
        future, self._future = self._future, None
        resolve(future)


class LeaderFetcher:
    """Every partition this server follows on one leader (a server at one address): one
    ReplicateMany call at a time carries all of them (docs/replication.md, "One call per
    leader"), as Kafka's replica fetcher does, and their answers are copied side by side
    before it asks again. A partition backing off after a failure sits out until its
    retry time; a partition added while a long poll is out ends that poll, so a new
    follower never waits a whole poll to begin."""

    def __init__(self, me: str, leader_address: str, stubs, fetch_wait_ms: int,
                 link_address: str = "", sessions: bool = True):
        self.me = me
        self.address = leader_address
        self.stubs = stubs
        self.fetch_wait_ms = fetch_wait_ms
        # The leader's replication link (partition_server/copy_link.py), when it advertises
        # one and is not in this process; over TLS when this process has TLS.
        self.link: LinkClient | None = None
        if link_address and local.servicer(leader_address, PARTITION_SERVICE) is None:
            self.link = LinkClient(link_address, local.channel_token(), local.channel_tls(),
                                   leader_address)
        self.followers: dict[str, Follower] = {}
        self._added = asyncio.Event()
        self._handling: dict[Follower, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        # The link's thread's rounds (`_express_rounds`; done once they end), their
        # followers, and the stop the event loop sets (under the lock, which also says
        # whether a call is out on the socket, to be cut short).
        self._express: concurrent.futures.Future | None = None
        self._express_followers: frozenset = frozenset()
        self._express_lock = threading.Lock()
        self._express_stop = False
        self._express_calling = False
        # The fetch session with this leader (docs/replication.md, "Fetch sessions"):
        # its id (0: the next call opens one), its last call's epoch, and each partition's
        # request as the leader's session holds it. Used by one call at a time (on the
        # event loop, or on the link's thread during its rounds).
        self.sessions = sessions
        self._session_id = 0
        self._session_epoch = 0
        self._session_sent: dict[tuple[str, int], partition_pb2.ReplicateRequest] = {}
        self._session_next: tuple | None = None  # what the call out now would make them

    def add(self, follower: Follower) -> None:
        self.followers[follower.name] = follower
        self.wake()  # the next round asks for it too
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"fetcher {self.address}")

    def wake(self) -> None:
        """End the long poll or the link thread's rounds now: the next round starts on
        the event loop, with every partition's `prepare`."""
        self._added.set()
        self._stop_express()

    @property
    def idle(self) -> bool:
        """No partition to copy and no call or copy under way."""
        return not self.followers and (self._task is None or self._task.done())

    async def remove(self, follower: Follower) -> None:
        """Stop copying for `follower`; returns once no copy of it is under way (an answer
        arriving later for it is dropped)."""
        if self.followers.get(follower.name) is follower:
            del self.followers[follower.name]
        express = self._express
        if express is not None and not express.done() and follower in self._express_followers:
            self._stop_express()
            await _finished(express)
        busy = self._handling.get(follower)
        if busy is not None:
            await asyncio.wait([busy])

    async def close(self) -> None:
        self.followers.clear()
        self._stop_express()
        if self.link is not None:
            self.link.close()
        if self._express is not None:
            await _finished(self._express)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        try:
            while self.followers:
                try:
                    await self._round()
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 — a bug must not stop every copy from here
                    log.exception("replica fetcher for %s", self.address)
                    await asyncio.sleep(FOLLOWER_RETRY_MAX_S)
        finally:
            if self.link is not None:
                self.link.disconnect()  # nothing left to copy: its connection and thread go

    async def _round(self) -> None:
        """One ReplicateMany for every partition ready to ask, and the copies it brings."""
        await failpoints.hold(failpoints.FOLLOWER_FETCH_HOLD)
        # Cleared before the partitions are gathered: one added meanwhile (while a
        # log reopens below) ends the next long poll at once, or the link thread's rounds.
        self._added.clear()
        with self._express_lock:
            self._express_stop = False
        now = time.monotonic()
        batch = []
        for follower in list(self.followers.values()):
            if follower.retry_at > now:
                continue
            request = await follower.prepare()
            if request is not None and self.followers.get(follower.name) is follower:
                batch.append((follower, request))
        if not batch:
            retry = min((f.retry_at for f in self.followers.values()), default=now)
            try:
                await asyncio.wait_for(self._added.wait(),
                                       max(0.0, retry - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            return
        # A partition backing off sits these calls out: the leader holds a call no longer
        # than until it may ask again, and the link thread's rounds end then.
        retry = min((f.retry_at for f in self.followers.values()
                     if f.retry_at > now), default=None)
        if self.link is not None and self.link.usable and not self._added.is_set():
            left = await self._run_express(batch, retry)
            if left is None:
                return  # stopped (a partition added or removed, or one may ask again)
        else:
            outcomes = await self._call([request for _follower, request in batch],
                                        _wait_until(self.fetch_wait_ms, retry))
            if outcomes is None:
                return  # a partition was added: ask again with it at once
            left = [(follower, request, outcome)
                    for (follower, request), outcome in zip(batch, outcomes)]
        m.REPLICATE_LOOP_ROUNDS.inc()
        await self._handle(left)

    async def _handle(self, outcomes: list) -> None:
        """Each follower's outcome (follower, request, outcome) acted on, side by side, on
        the event loop."""
        handling = []
        for follower, request, outcome in outcomes:
            if self.followers.get(follower.name) is not follower:
                continue  # removed meanwhile: its log may be closed
            if outcome is None:
                follower.quiet()  # nothing new: it asks again in the next call
                continue
            task = asyncio.ensure_future(follower.handle(request, outcome))
            self._handling[follower] = task
            handling.append((follower, task))
        try:
            await asyncio.gather(*(task for _follower, task in handling))
        finally:
            for follower, task in handling:
                if self._handling.get(follower) is task:
                    del self._handling[follower]

    async def _call(self, requests: list, wait_ms: int | None = None) -> list | None:
        """One ReplicateMany for `requests`: per request a ReplicateAnswer, an
        exception, or None (nothing new); None for the whole when a partition was added
        before the answer came. (The stub's answer is a ReplicateManyAnswer, parsed by
        `ReplicaStub`'s deserializer or returned as is by an in-process leader.)"""
        request = self._many_request(requests, wait_ms)
        timeout_s = self.fetch_wait_ms / 1000 + 10
        link = self.link if self.link is not None and self.link.usable else None
        if link is not None:
            answer = asyncio.ensure_future(link.replicate_many(request, timeout_s))
            cancel = link.cancel
        else:
            rpc = self.stubs.get(self.address).ReplicateMany(request, timeout=timeout_s)
            answer = asyncio.ensure_future(rpc)
            cancel = rpc.cancel
        added = asyncio.ensure_future(self._added.wait())
        try:
            done, _pending = await asyncio.wait({answer, added},
                                                return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            cancel()
            answer.cancel()
            raise
        finally:
            added.cancel()
        if answer not in done:
            cancel()
            answer.cancel()
            self._session_lost()
            return None
        m.REPLICATE_CALLS.inc()
        if answer.cancelled():  # the channel closed under the call (not this task)
            self._session_lost()
            failure = AtomlogError("SERVER_UNAVAILABLE",
                                   f"ReplicateMany to {self.address} was cancelled")
            return [failure] * len(requests)
        try:
            response = answer.result()
        except LinkUnavailable as error:
            self._session_lost()
            self._link_unavailable(error)
            return await self._call(requests, wait_ms)
        except Exception as error:  # noqa: BLE001 — each partition backs off and retries
            self._session_lost()
            failure = errors.from_rpc_error(error) \
                if isinstance(error, grpc.aio.AioRpcError) else error
            if getattr(failure, "reason", "") == "REPLICATE_SESSION_INVALID":
                return await self._call(requests, wait_ms)  # (opens a new session)
            return [_said_by_leader(failure)] * len(requests)
        self._session_answered(response)
        return _outcomes(requests, response)

    def _link_unavailable(self, error: LinkUnavailable) -> None:
        # No link to this leader now: this call and those of the next seconds go by gRPC
        # (the request only reports positions and reads: asking twice is safe).
        event(log, "replication link unavailable; using gRPC", logging.WARNING,
              leader=self.address, link=self.link.address, why=str(error))
        LINK_FALLBACKS.inc()

    def _many_request(self, requests: list, wait_ms: int | None = None
                      ) -> partition_pb2.ReplicateManyRequest:
        """The ReplicateMany asking for `requests`: all of them when no session is open
        (opening one, with `sessions`), else only those the session does not hold as they
        are, and the partitions that left it as `forgotten`. `_session_answered` makes the
        session what the leader now holds once the answer comes; a failed call leaves it
        closed (`_session_lost`): the next call opens a new one."""
        wait = self.fetch_wait_ms if wait_ms is None else wait_ms
        if not self.sessions:
            m.REPLICATE_NAMED.inc(len(requests))
            return partition_pb2.ReplicateManyRequest(
                replica=self.me, max_wait_ms=wait, max_bytes=REPLICATE_MANY_MAX_BYTES,
                partitions=requests)
        now = {(r.topic_partition.topic, r.topic_partition.partition): r for r in requests}
        if not self._session_id or self._session_epoch >= SESSION_EPOCH_MAX:
            self._session_next = (1, now)  # (opening: the session holds `now`)
            m.REPLICATE_NAMED.inc(len(requests))
            return partition_pb2.ReplicateManyRequest(
                replica=self.me, max_wait_ms=wait, max_bytes=REPLICATE_MANY_MAX_BYTES,
                partitions=requests, session_epoch=1)
        sent = self._session_sent
        changes = {key: r for key, r in now.items() if sent.get(key) is not r}
        changes.update((key, None) for key in sent if key not in now)
        return self._incremental(changes, wait)

    def _changes_request(self, current: dict, changed, wait_ms: int
                         ) -> partition_pb2.ReplicateManyRequest:
        """`_many_request` for the link thread's rounds, costing what changed: `current`
        holds each partition's (follower, request), and only the keys in `changed` (those
        a copy may have moved, or removed) can differ from what the session holds."""
        if changed is None or not self.sessions or not self._session_id \
                or self._session_epoch >= SESSION_EPOCH_MAX:
            return self._many_request([request for _follower, request in current.values()],
                                      wait_ms)
        sent = self._session_sent
        changes = {}
        for key in changed:
            entry = current.get(key)
            if entry is None:
                if key in sent:
                    changes[key] = None
            elif sent.get(key) is not entry[1]:
                changes[key] = entry[1]
        return self._incremental(changes, wait_ms)

    def _incremental(self, changes: dict, wait_ms: int) -> partition_pb2.ReplicateManyRequest:
        """The session's next call: `changes` maps each partition whose request the session
        does not hold as it is to that request, or to None for one that left it."""
        epoch = self._session_epoch + 1
        self._session_next = (epoch, changes)
        named = [request for request in changes.values() if request is not None]
        m.REPLICATE_NAMED.inc(len(named))
        return partition_pb2.ReplicateManyRequest(
            replica=self.me, max_wait_ms=wait_ms, max_bytes=REPLICATE_MANY_MAX_BYTES,
            partitions=named, session_id=self._session_id, session_epoch=epoch,
            forgotten=[common_pb2.TopicPartition(topic=key[0], partition=key[1])
                       for key, request in changes.items() if request is None])

    def _session_answered(self, answer) -> None:
        """The call `_many_request` (or `_changes_request`) made last was answered: the
        leader's session holds what it asked for (or the leader holds none: every call
        then names all)."""
        if self._session_next is None:
            return
        epoch, changes = self._session_next
        self._session_next = None
        session_id = getattr(answer, "session_id", 0)
        if epoch == 1:
            self._session_id = session_id
            if session_id:
                m.REPLICATE_SESSIONS_OPENED.inc()
        elif session_id != self._session_id:  # (not an answer of this session)
            self._session_lost()
            return
        if not self._session_id:
            self._session_epoch, self._session_sent = 0, {}
            return
        self._session_epoch = epoch
        if epoch == 1:
            self._session_sent = changes
            return
        sent = self._session_sent
        for key, request in changes.items():
            if request is None:
                sent.pop(key, None)
            else:
                sent[key] = request

    def _session_lost(self) -> None:
        """A call failed or was cut short (the leader may or may not have applied it), or
        the leader refused the session: the next call opens a new one."""
        self._session_id = self._session_epoch = 0
        self._session_sent = {}
        self._session_next = None

    # ------------------------------------------------------ rounds on the link's thread
    async def _run_express(self, batch: list, deadline: float | None = None) -> list | None:
        """Rounds on the link's thread (docs/replication.md, "Rounds on the link's
        thread") while every answer is plain: each partition's records are checked,
        appended and fsynced there and the next call goes out, with no hop to the event
        loop and back. `deadline` (time.monotonic()): when the first partition left out
        of `batch` (backing off) may ask again; the rounds end then, so the event loop's
        next round asks for it. Returns the (follower, request, outcome) the event loop
        acts on (an answer that is not plain, a failed copy, a failed call), or None when
        the rounds stopped (a partition added or removed, or `deadline` came) with
        nothing left to do."""
        self._express_followers = frozenset(follower for follower, _request in batch)
        self._express = self.link.submit(self._express_rounds, batch, deadline)
        left, failure = await _finished(self._express)
        if failure is None:
            return left or None
        if self._express_stop:
            return None  # the call was cut by the event loop: nothing to act on
        if getattr(failure, "reason", "") == "REPLICATE_SESSION_INVALID":
            return None  # ask again at once, opening a new session
        if isinstance(failure, LinkUnavailable):
            self._link_unavailable(failure)
            outcomes = await self._call([request for _follower, request in left])
            if outcomes is None:
                return None
            return [(follower, request, outcome)
                    for (follower, request), outcome in zip(left, outcomes)]
        return [(follower, request, _said_by_leader(failure)) for follower, request in left]

    def _express_rounds(self, batch: list, deadline: float | None = None
                        ) -> tuple[list, BaseException | None]:
        """On the link's thread: calls and plain copies until an outcome needs the event
        loop, the loop asks to stop or `deadline` comes (each call's long poll ends by
        then). Returns (outcomes for the loop, None), empty when stopped or at the
        deadline, or (the last call's (follower, request) pairs, the call's failure).

        After the first call a round costs the partitions answered, not all of them: only
        an answered partition's request can move here (the event loop stops these rounds
        before it adds or removes a partition, or acts on one), so only those are asked
        for their next request, and in a fetch session only those are named."""
        current = {follower.key: (follower, request) for follower, request in batch}
        changed = None  # (the first call: every partition)
        timeout_s = self.fetch_wait_ms / 1000 + 10
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                return [], None  # a partition backing off may ask again
            if failpoints.armed(failpoints.FOLLOWER_FETCH_HOLD):
                return [], None  # the event loop's next round holds (tests)
            wait_ms = _wait_until(self.fetch_wait_ms, deadline)
            with self._express_lock:
                if self._express_stop:
                    return [], None
                self._express_calling = True
            try:
                answer = self.link.exchange(self._changes_request(current, changed, wait_ms),
                                            timeout_s)
            except Exception as error:  # noqa: BLE001 — the event loop decides what it means
                self._session_lost()
                return list(current.values()), error
            finally:
                with self._express_lock:
                    self._express_calling = False
            self._session_answered(answer)
            m.REPLICATE_CALLS.inc()
            first, left, changed = changed is None, [], []
            for result in answer.results:
                tp = result.topic_partition
                entry = current.get((tp.topic, tp.partition))
                if entry is None:
                    continue  # not asked for: ignored
                follower, request = entry
                if self.followers.get(follower.name) is not follower:
                    continue  # removed: the event loop is stopping these rounds
                changed.append(follower.key)
                outcome = _outcome(result)
                if isinstance(outcome, BaseException) or \
                        not follower.copies_in_place(request, outcome):
                    left.append((follower, request, outcome))
                else:
                    try:
                        follower.copy_in_place(request, outcome)
                    except Exception as error:  # noqa: BLE001 — `handle` backs it off
                        left.append((follower, request, error))
            if first:  # the call went well for the others (they ask again as they were)
                answered = set(changed)
                for key, (follower, _request) in current.items():
                    if key not in answered:
                        follower.quiet()
            if left:
                return left, None
            for key in changed:
                follower = current[key][0]
                current[key] = (follower, follower.request())

    def _stop_express(self) -> None:
        """Ends the link thread's rounds once their copies under way are done; a call out
        on the socket (a long poll) is cut short."""
        with self._express_lock:
            self._express_stop = True
            if self._express_calling and self.link is not None:
                self.link.cancel()


def _wait_until(wait_ms: int, deadline: float | None) -> int:
    """A long poll's max_wait_ms: `wait_ms`, or less so that it ends by `deadline`
    (time.monotonic(); None: none), 0 once that has come."""
    if deadline is None:
        return wait_ms
    left_s = deadline - time.monotonic()
    return 0 if left_s <= 0 else min(wait_ms, int(left_s * 1000) + 1)


def _carries_cursors(response) -> bool:
    """Whether a Replicate answer brings cursor state to copy (a snapshot or frames)."""
    return bool(response.cursors_available
                and (response.cursor_snapshot or response.cursor_frames))


def _outcomes(requests: list, response) -> list:
    """Per request, from a ReplicateMany answer: its ReplicateAnswer, its error, or None
    (nothing new)."""
    position = {(r.topic_partition.topic, r.topic_partition.partition): index
                for index, r in enumerate(requests)}
    outcomes: list = [None] * len(requests)
    for result in response.results:
        index = position.get((result.topic_partition.topic,
                              result.topic_partition.partition))
        if index is not None:  # (else not asked for: ignored)
            outcomes[index] = _outcome(result)
    return outcomes


def _outcome(result):
    """A ReplicateMany result's ReplicateAnswer, or its error (`_said_by_leader`)."""
    if result.error.reason:
        return _said_by_leader(errors.from_item(result.error))
    # (a result without a response reads as an empty one)
    return result.response if result.response is not None else ReplicateAnswer()


def _said_by_leader(error: BaseException) -> BaseException:
    """Marks an error as the leader's answer (an item's error, a failed call), not one
    of this follower's own log: `Follower.handle` reopens its log only for those."""
    error.said_by_leader = True
    return error


async def _finished(future: concurrent.futures.Future):
    """The result of work on a link's thread, waited for until it ends: a cancelled
    waiter does not end the work (whoever closes a log it writes waits for it)."""
    return await asyncio.shield(asyncio.wrap_future(future))


class ReplicaStub(partition_pb2_grpc.PartitionServiceStub):
    """The PartitionService stub of a follower: Replicate and ReplicateMany parse their
    answers with replicate_wire (records as slices of the received buffer, not copied
    through a message); every other method as generated."""

    def __init__(self, channel):
        super().__init__(channel)
        self.Replicate = channel.unary_unary(
            "/atomlog.v1.PartitionService/Replicate",
            request_serializer=partition_pb2.ReplicateRequest.SerializeToString,
            response_deserializer=parse_answer, _registered_method=True)
        self.ReplicateMany = channel.unary_unary(
            "/atomlog.v1.PartitionService/ReplicateMany",
            request_serializer=partition_pb2.ReplicateManyRequest.SerializeToString,
            response_deserializer=parse_many, _registered_method=True)


# The leader's serializers of the same two methods (partition_server/server.py installs
# them): the records spliced into the answer's bytes.
RESPONSE_SERIALIZERS = {"Replicate": serialize_answer, "ReplicateMany": serialize_many}


def _wipe_log(directory) -> None:
    import shutil
    from pathlib import Path
    for path in Path(directory).iterdir():
        if path.name.startswith("cursors"):  # the cursor store (and an install of it)
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
