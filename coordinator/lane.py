"""The commit lane: one-call commits whose partitions this process hosts (the combined
server), carried out in event-loop callbacks instead of through the staging channel.

A one-call commit on the staging channel (coordinator/staging.py) passes through a
per-destination queue, its sender task, a StageTxnRequest, the partition servicer's
StageTxn (its gather, its response) and the results' conversion, and its handler wakes
for the begin, the stages and the decision. On the combined server all of that is one
process talking to itself, and measured it is most of a transaction's CPU that is not
the cores' own work (docs/benchmarks.md, "Is it Python, or how the server is built?").
The lane does the same steps in the caller's step and in the callbacks of the futures
they return:

    commit()      the handler queues the commit (validated, routed to its TC partition)
                  and waits for one answer; every commit queued in one event-loop turn
                  forms a group, taken in one callback
    _take_group   per commit: begin_one_call on its TC partition's core; then the
                  lingering markers of the group's partitions (as StageTxn's riders)
                  and every commit's batches queued on their owners
                  (PartitionServicer.stage_here) and acks staged on their cursors
                  (stage_ack_here), in this one step, so they share the owners' next
                  write and fsync and the cursor stores' next durability round
    _staged       a commit's last stage answered: its decision (end_one_call), whose
                  append the TC partition's writer makes as for any call
    _decided      its appends durable: the handler gets the decision and answers as
                  CommitTxn always has (CoordinatorServicer._decided)

With coordinator.lane_one_round (the default) `_take_group` does more in its step
(`_stage_in_step`): the owners write the group's riders and stages in it (a gathering,
partition_server/owner.py), and each commit whose batches were all written there is
decided in it too, its decision written on the TC log's owner after its stages, so both
are durable in one write-ahead round; the next group waits for that round. Its frames are
fatal (partition_server/wal.py, WalTap.fatal): a failed round stops the server, whose
start replays the file in one pass (docs/coordinator.md, "One round a commit").

Everything the staging channel would do differently hands the commit back to the
handler, which goes on from where the lane stopped on the ordinary path: a begin that
must wait for a sequence reservation to be logged, a batch refused for a reason
StageTxn retries (an owner moved, loading, a full queue, a stale route) or not hosted
here, and an armed `one_call_decide` failpoint (tests hold a commit between staging and
its decision there). So every rule stays where it was: the cores decide, the owners
and cursor stores check and write, the lane only calls them. A parallel commit and
CommitTxns (chained commits) take the ordinary path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from atomlog.v1 import partition_pb2

from coordinator import metrics as marker_metrics
from coordinator.records import Decision
from coordinator.staging import (
    PARTITION_SERVICE,
    RETRY_REASONS,
    RIDING_MARKERS,
    STAGE_SECONDS,
    STAGED,
    _error_of,
)
from partition_server import owner as partition_owner
from partition_server.owner import Marker as PartitionMarker
from partition_server.record_batch import ControlType
from partition_server.record_batch import TxnId as PartitionTxnId
from services import failpoints, local
from services.batching import WhenAllDone, failure_of, observe_failure
from services.errors import AtomlogError
from services.fastmetrics import Counter

log = logging.getLogger("atomlog.coordinator.lane")

LANE_COMMITS = Counter("atomlog_coordinator_lane_commits_total",
                       "One-call commits the commit lane took (coordinator/lane.py), by how "
                       "they left it: decided there, or handed back to the ordinary path "
                       "(reservation, restage, failpoint).", ["result"])
LANE_ONE_ROUND = Counter("atomlog_coordinator_lane_one_round_commits_total",
                         "One-call commits the commit lane decided in their group's own step, "
                         "their decision written after their stages and durable in the same "
                         "write-ahead round (coordinator.lane_one_round).")
LANE_RIDERS_IN_STEP = Counter("atomlog_coordinator_lane_riders_confirmed_in_step_total",
                              "Riding markers the commit lane confirmed in its group's step, "
                              "written there before the Completed records they lead to "
                              "(CommitLane._riders_in_step); the others are confirmed once "
                              "durable.")
MAX_GROUP = 1_000  # commits taken in one callback; the rest wait for the next turn
MAX_QUEUED = 10_000  # commits waiting for the lane; beyond, the ordinary path takes them


@dataclass(eq=False)
class LaneOutcome:
    """What the lane did with a commit, for its handler to finish: `result` is
    end_one_call's reply once decided; else the handler goes on from `begun` on the
    ordinary path: `begin_futures` to wait for first (a sequence reservation), and
    `staged`/`failure` once staging ended (`staged` not None: the decision held by a
    failpoint), else the whole staging again."""

    begun: object  # coordinator.server._OneCallBegun
    result: object = None
    staged: list | None = None
    failure: AtomlogError | None = None
    begin_futures: list | None = None


class _Commit:
    __slots__ = ("request", "k", "key", "session", "tps", "subs", "partition",
                 "call_deadline", "here", "future", "begun", "stages", "acks", "pending",
                 "timer", "began", "group")

    def __init__(self, request, k, key, session, tps, subs, partition, call_deadline, here):
        self.request = request
        self.here = here  # this process's PartitionServicer
        self.k = k
        self.key = key
        self.session = session
        self.tps = tps
        self.subs = subs
        self.partition = partition
        self.call_deadline = call_deadline  # time.monotonic(), or None: the call's own
        self.future: asyncio.Future | None = None
        self.begun = None
        self.stages: list = []  # (ProduceItem, owner, the owner's queued work) per batch
        self.acks: list = []  # (AckItem, its future or its refusal) per ack
        self.pending = 0  # stages not yet answered; -1 once staging ended
        self.timer: asyncio.TimerHandle | None = None
        self.began = 0.0
        self.group: _Group | None = None


class _Group:
    """The commits taken together: how many still stage, and the timer that stops the
    next group waiting for them."""

    __slots__ = ("staging", "logging", "timer")

    def __init__(self) -> None:
        self.staging = 0
        self.logging = 0  # commits decided in the group's step whose decision is not durable
        self.timer: asyncio.TimerHandle | None = None


class CommitLane:
    """One per coordinator: see the module doc."""

    def __init__(self, coordinator, begun_type):
        self.c = coordinator
        self._begun_type = begun_type  # server._OneCallBegun (kept out of an import cycle)
        self._queue: list[_Commit] = []
        self._scheduled = False
        self._holding: _Group | None = None  # the group the next one waits for
        # A done future, set as the work of each batch a commit decided in its group's
        # step: its answer is the decision's (durable in the same round, or the server
        # stops: WalTap.fatal), so the owner's flush has nothing to answer there and
        # schedules no callback for it (`_decide`).
        self._answered: asyncio.Future | None = None
        self._step_riders: tuple | None = None  # (riders, MarkersHere) of the group's step

    def servicer_for(self, request):
        """The partition servicer of this process when it hosts (by the routes' cache)
        the first batch's (or ack's) partition of a CommitTxn the lane may take; else
        None: the ordinary path. stage_here checks every batch for real. None also while
        MAX_QUEUED commits wait for the lane (the ordinary path has bounds of its own)."""
        if len(self._queue) >= MAX_QUEUED or failpoints.armed(failpoints.ONE_CALL_STAGE):
            return None
        address = self._address(request)
        return local.servicer(address, PARTITION_SERVICE) if address else None

    def _address(self, request) -> str:
        """The cached owner of a CommitTxn's first partition ("" for none)."""
        tp = (request.batches[0].topic_partition if request.batches
              else request.acks[0].subscription_partition if request.acks else None)
        return self.c.routes.cached_owner(tp.topic, tp.partition) if tp is not None else ""

    def commit(self, request, k, key, session, tps, subs, partition, here,
               call_deadline: float | None) -> asyncio.Future:
        """Queue a validated CommitTxn; the future of its LaneOutcome (or the response
        of an already ended key, or the exception the ordinary path would raise)."""
        commit = _Commit(request, k, key, session, tps, subs, partition, call_deadline, here)
        commit.future = asyncio.get_running_loop().create_future()
        self._queue.append(commit)
        self._schedule()
        return commit.future

    def _schedule(self) -> None:
        """The next group, once the one in flight has staged (the group on the owners is
        the linger, as a staging channel's call in flight is), or once it has taken
        longer than a staging call may (coordinator.log_request_timeout_ms): a slow disk
        under one partition holds the others up no longer than it would there."""
        if self._queue and not self._scheduled and self._holding is None:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._take_group)

    def _release(self, group: "_Group") -> None:
        if self._holding is group:
            self._holding = None
            if group.timer is not None:
                group.timer.cancel()
            self._schedule()

    # ------------------------------------------------------------------ the steps

    def _take_group(self) -> None:
        self._scheduled = False
        taken, self._queue = self._queue[:MAX_GROUP], self._queue[MAX_GROUP:]
        begun = [commit for commit in taken if self._begin(commit)]
        if begun:
            group = _Group()
            self._holding = group
            # (Set first: whatever a bug raises below, the next group is not held for ever.)
            group.timer = asyncio.get_running_loop().call_later(
                self.c.settings.log_request_timeout_ms / 1000, self._release, group)
            try:
                if self.c.settings.lane_one_round:
                    self._stage_in_step(begun, group)
                else:
                    self._stage(begun, group)
            finally:
                if not group.staging and not group.logging:
                    self._release(group)
        self._schedule()  # (more than MAX_GROUP queued, or nothing went to staging)

    def _stage(self, begun: list[_Commit], group: "_Group", wait: bool = True) -> None:
        """The group's riders, then each commit's stages, queued (`_stage_one`). Not
        `wait`: in the group's step (`_stage_in_step`), which answers the riders."""
        try:
            self._riders(begun, in_step=not wait)
        except Exception:  # noqa: BLE001 — a bug: the markers are sent again by the ticks
            log.exception("commit lane: the riding markers failed")
        for commit in begun:
            commit.group = group
            try:
                self._stage_one(commit, wait)
            except Exception as error:  # noqa: BLE001 — a bug: the caller hears of it
                log.exception("commit lane: staging failed")
                if commit.pending > 0:
                    commit.pending = -1
                    group.staging -= 1
                self._fail(commit, error)

    def _stage_in_step(self, begun: list[_Commit], group: "_Group") -> None:
        """coordinator.lane_one_round: the group's riders and stages queued on their
        owners, which write them in this step (owner.gather); every commit whose batches
        were all written here (and that has no acks: a cursor's durability round is its
        own) is decided here too, and its decision appended on its TC log's owner and
        written after its stages, so that its frames follow theirs in the same
        write-ahead round and a durable decision implies durable stages. The gathering's
        close begins the owners' flushes. A commit whose batches an owner could not write
        here, or whose decision could not be written here (TcPartition.appends_in_step),
        waits for its stages as `_stage` has it, then for its decision's round."""
        gathering = partition_owner.gather()
        try:
            self._stage(begun, group, wait=False)
            for owner in list(gathering.owners):
                owner.write_gathered()
            wrote = gathering.owners
            self._riders_in_step(wrote)
            partitions = {}
            for commit in begun:
                if commit.pending <= 0:
                    continue
                written = not commit.acks  # (a loop: all() of a generator resumes it each time)
                for _, owner, work in commit.stages:
                    if not (wrote.get(owner) and work.results):
                        written = False
                        break
                if not written or not commit.partition.appends_in_step():
                    self._wait_for_stages(commit)
                    continue
                partitions[id(commit.partition)] = commit.partition
                commit.pending = -1
                group.staging -= 1
                try:
                    self._decide(commit, None, in_step=True)
                except Exception as error:  # noqa: BLE001 — a bug: the caller hears of it
                    log.exception("commit lane: deciding failed")
                    self._fail(commit, error)
            for partition in partitions.values():
                partition.append_scheduled_now()  # on the TC log's owner: gathered
            for owner, written in list(wrote.items()):
                if not written:  # (the TC logs' owners)
                    owner.write_gathered()
        finally:
            gathering.close()
            if self._step_riders is not None:  # (a bug raised above: answered once durable)
                _riders_answered_later(*self._step_riders)
                self._step_riders = None
            for commit in begun:  # (a bug raised above: none is left unanswered)
                if commit.pending > 0 and commit.timer is None:
                    try:
                        self._wait_for_stages(commit)
                    except Exception as error:  # noqa: BLE001 — the caller hears of it
                        self._fail(commit, error)

    def _logged_in_step(self, group: "_Group") -> None:
        group.logging -= 1
        if not group.staging and not group.logging:
            self._release(group)

    def _stage_one(self, commit: _Commit, wait: bool = True) -> None:
        """Queue a begun commit's batches on their owners (`_staged` once answered)."""
        queued = commit.here.stage_here(commit.begun.start.txn_id, commit.partition.epoch,
                                        commit.request.batches)
        if isinstance(queued, AtomlogError):
            # StageTxn's answer to it: retried, refused or routed there.
            self._hand_back(commit, LaneOutcome(commit.begun), "restage")
            return
        commit.began = time.perf_counter()
        commit.stages = [(item, owner, work) for item, (owner, work)
                         in zip(commit.request.batches, queued)]
        txn_id = commit.begun.start.txn_id
        commit.acks = [(ack, commit.here.stage_ack_here(txn_id, commit.partition.epoch, ack))
                       for ack in commit.request.acks]
        commit.pending = len(commit.stages) + sum(
            not isinstance(held, AtomlogError) for _, held in commit.acks)
        commit.group.staging += 1
        if not commit.pending:  # (every ack refused at once)
            self._staged(commit, None)
            return
        if wait:
            self._wait_for_stages(commit)

    def _wait_for_stages(self, commit: _Commit) -> None:
        """`_staged` once every stage of the commit is answered (or its time is up)."""
        futures = [work.future for _, _, work in commit.stages] + [
            held for _, held in commit.acks if not isinstance(held, AtomlogError)]
        done = _StageDone(self, commit)
        for future in futures:
            future.add_done_callback(done)
        deadline = commit.begun.timeout_at if commit.call_deadline is None else min(
            commit.begun.timeout_at, commit.call_deadline)
        loop = asyncio.get_running_loop()
        commit.timer = loop.call_at(loop.time() + max(0.01, deadline - time.monotonic()),
                                    self._timed_out, commit)

    def _begin(self, commit: _Commit) -> bool:
        """begin_one_call; whether the commit goes on to staging here."""
        request = commit.request
        try:
            start, futures = commit.partition.call_now(lambda core, now: core.begin_one_call(
                now, request.timeout_ms, commit.session, commit.key, commit.tps,
                commit.subs))
        except Exception as error:  # noqa: BLE001 — the caller's answer
            self._fail(commit, error)
            return False
        begun = self._begun_type(commit.k, commit.partition, start,
                                 time.monotonic() + start.timeout_ms / 1000)
        commit.begun = begun
        if futures:  # a sequence reservation: nothing is staged before it is durable
            self._hand_back(commit, LaneOutcome(begun, begin_futures=futures), "reservation")
            return False
        if start.existing is not None:
            self._settle(commit, LaneOutcome(begun))
            return False
        return True

    def _riders(self, group: list[_Commit], in_step: bool = False) -> None:
        """The lingering markers of the group's partitions, queued on their owners before
        the stages (as StageTxn applies its riders, but as objects: no request and no
        response to build and read in one process), confirmed to their TC partitions
        once written (as MarkerChannel.answered confirms them), or `in_step` by
        `_riders_in_step`."""
        markers = self.c.markers
        address = self._address(group[0].request)
        markers.staging_to(address)
        if failpoints.armed(failpoints.MARKERS_SEND):
            return
        partitions = set()
        for commit in group:
            for item in commit.request.batches:
                partitions.add((item.topic_partition.topic, item.topic_partition.partition))
            for ack in commit.request.acks:
                sp = ack.subscription_partition
                partitions.add((sp.topic, sp.partition))
        riders = markers.take_riders(address, partitions)
        if not riders:
            return
        try:
            queued = group[0].here.queue_markers_here([(marker.target, PartitionMarker(
                PartitionTxnId(marker.txn_id.tc_partition, marker.txn_id.sequence),
                ControlType.COMMIT if marker.decision is Decision.COMMIT
                else ControlType.ABORT, marker.coordinator_epoch)) for _, marker in riders])
        except Exception:
            markers.give_back(address, riders)  # they go alone, as after a failed call
            raise
        RIDING_MARKERS.inc(len(riders))
        if in_step:
            self._step_riders = (riders, queued)
        else:
            _riders_answered_later(riders, queued)

    def _riders_in_step(self, wrote: dict) -> None:
        """The group's riders, once the owners wrote in its step (`wrote`: the
        gathering's owners): confirmed now when every one was written there
        (MarkersHere.settle_written) and every TC partition they confirm to appends in
        this process's write-ahead file (TcPartition.appends_follow_here). Their
        Completed records are then appended after their frames (with the step's
        decisions, or later), so a durable Completed record implies a durable marker,
        as a durable decision implies its durable stages. Else once durable, as ever."""
        taken, self._step_riders = self._step_riders, None
        if taken is None:
            return
        riders, queued = taken
        outcomes = None
        sinks = {id(sink): sink for sink, _ in riders}
        if all(sink.appends_follow_here() for sink in sinks.values()):
            outcomes = queued.settle_written(wrote, self._done())
        if outcomes is None:
            _riders_answered_later(riders, queued)
            return
        LANE_RIDERS_IN_STEP.inc(len(riders))
        _riders_answered(riders, outcomes)

    def _done(self) -> asyncio.Future:
        """A done future (see __init__)."""
        answered = self._answered
        if answered is None:
            answered = self._answered = asyncio.get_running_loop().create_future()
            answered.set_result(None)
        return answered

    def _stage_done(self, commit: _Commit) -> None:
        if commit.pending < 0:
            return  # timed out already
        commit.pending -= 1
        if commit.pending == 0:
            self._staged(commit, None)

    def _timed_out(self, commit: _Commit) -> None:
        if commit.pending > 0:
            self._staged(commit, AtomlogError(
                "REQUEST_TIMED_OUT", "staging on this server did not answer within the "
                "transaction's time"))

    def _staged(self, commit: _Commit, timed_out: AtomlogError | None) -> None:
        """Every stage answered (or the time is up): the decision."""
        commit.pending = -1
        group = commit.group
        group.staging -= 1
        if not group.staging and not group.logging:
            self._release(group)
        if commit.timer is not None:
            commit.timer.cancel()
        try:
            self._decide(commit, timed_out)
        except Exception as error:  # noqa: BLE001 — a bug: the caller hears of it
            log.exception("commit lane: deciding failed")
            self._fail(commit, error)

    def _decide(self, commit: _Commit, timed_out: AtomlogError | None,
                in_step: bool = False) -> None:
        STAGE_SECONDS.observe(time.perf_counter() - commit.began)
        failure, retry = timed_out, False
        staged = []
        if failure is None:
            answered = self._done() if in_step else None
            for item, owner, work in commit.stages:
                if in_step:  # (written in this step, durable with its decision)
                    result = commit.here.written_result(item.topic_partition, owner,
                                                        work.results[0])
                    work.future = answered  # (nothing waits for it: see __init__)
                else:
                    result = commit.here.staged_result(item.topic_partition, owner,
                                                       work.future)
                reason = result.error.reason
                if reason and reason not in RETRY_REASONS:
                    tp = item.topic_partition
                    failure = failure or _error_of(result.error, f"{tp.topic}-{tp.partition}")
                retry |= reason in RETRY_REASONS
                staged.append(result)
            for ack, held in commit.acks:
                error = held if isinstance(held, AtomlogError) else failure_of(
                    held, "staging an ack")
                if error is None:
                    continue
                sp = ack.subscription_partition
                if error.reason not in RETRY_REASONS:
                    failure = failure or _error_of(error, f"{sp.topic}-{sp.partition} "
                                                   f"(subscription {sp.subscription})")
                retry |= error.reason in RETRY_REASONS
        else:
            for _, _, work in commit.stages:
                work.future.add_done_callback(observe_failure)
            for _, held in commit.acks:
                if not isinstance(held, AtomlogError):
                    held.add_done_callback(observe_failure)
        if failure is None and retry:
            self._hand_back(commit, LaneOutcome(commit.begun), "restage")
            return
        STAGED.labels("ok" if failure is None else failure.reason).inc()
        if failpoints.armed(failpoints.ONE_CALL_DECIDE):
            self._hand_back(commit, LaneOutcome(commit.begun, staged=staged, failure=failure),
                            "failpoint")
            return
        txn_id = commit.begun.start.txn_id
        try:
            result, futures = commit.partition.call_now(
                lambda core, now: core.end_one_call(now, txn_id, failure))
        except Exception as error:  # noqa: BLE001 — the caller's answer
            self._fail(commit, error)
            return
        outcome = LaneOutcome(commit.begun, result=result, staged=staged)
        LANE_COMMITS.labels("decided").inc()
        if in_step:
            LANE_ONE_ROUND.inc()
        if not futures:
            self._settle(commit, outcome)
            return
        if in_step:  # the next group waits for this decision's round too
            group = commit.group
            group.logging += 1
            WhenAllDone(futures, lambda: (self._logged_in_step(group),
                                          self._logged(commit, outcome, futures)))
            return
        WhenAllDone(futures, lambda: self._logged(commit, outcome, futures))

    def _logged(self, commit: _Commit, outcome: LaneOutcome, futures: list) -> None:
        for future in futures:
            error = future.exception()
            if error is not None:
                self._fail(commit, error)
                return
        self._settle(commit, outcome)

    # ------------------------------------------------------------------ answers

    def _hand_back(self, commit: _Commit, outcome: LaneOutcome, why: str) -> None:
        LANE_COMMITS.labels(why).inc()
        self._settle(commit, outcome)

    @staticmethod
    def _settle(commit: _Commit, outcome) -> None:
        if not commit.future.done():  # (its caller went away: the commit went on)
            commit.future.set_result(outcome)

    @staticmethod
    def _fail(commit: _Commit, error: BaseException) -> None:
        if not commit.future.done():
            commit.future.set_exception(error)
            observe_failure(commit.future)


def _riders_answered_later(riders: list, queued) -> None:
    """`_riders_answered` once the riders' owners made them durable (MarkersHere)."""
    queued.answer.add_done_callback(lambda future: _riders_answered(riders, future.result()))


def _riders_answered(riders: list, outcomes: list) -> None:
    """Each rider's outcome back to its TC partition, as MarkerChannel.answered does: a
    marker written (or not needed) is confirmed; a stale epoch tells the TC partition
    its lease is gone; anything else is sent again by the TC partition's tick."""
    stale = set()
    confirmed: dict[tuple[int, int], tuple[object, list]] = {}  # per (sink, epoch)
    for (sink, marker), outcome in zip(riders, outcomes):
        if not isinstance(outcome, AtomlogError):
            key = (id(sink), marker.coordinator_epoch)
            entry = confirmed.get(key)
            if entry is None:
                entry = confirmed[key] = (sink, [])
            entry[1].append((marker.txn_id, marker.target))
            continue
        marker_metrics.MARKER_FAILURES.labels(outcome.reason).inc()
        if outcome.reason == "STALE_COORDINATOR_EPOCH" and \
                (id(sink), marker.coordinator_epoch) not in stale:
            stale.add((id(sink), marker.coordinator_epoch))
            sink.marker_epoch_stale(marker.coordinator_epoch)
    for (_, epoch), (sink, pairs) in confirmed.items():
        marker_metrics.MARKERS_CONFIRMED.inc(len(pairs))
        sink.markers_confirmed(pairs, epoch)


class _StageDone:
    """A commit's stage futures' callback (one object per commit, not a closure each)."""

    __slots__ = ("lane", "commit")

    def __init__(self, lane: CommitLane, commit: _Commit):
        self.lane, self.commit = lane, commit

    def __call__(self, _future) -> None:
        self.lane._stage_done(self.commit)
