"""Presumed abort on the partition server: look up old open transactions.

A one-call transaction (CoordinatorService.CommitTxn) is staged here before anything of
it is logged at its coordinator. If the coordinator fails before it logs the decision,
or its ABORT markers are lost, the staged data (or pending acks) would stay open here
forever, holding max_read_position back. So every `interval` this task looks over the
open transactions of every partition it owns — data in the transaction buffer and acks
pending on subscription cursors — and asks the coordinator about each one it has seen
open for `check_after` (VerifyTxnPartitions, batched per coordinator by the verifier).
The coordinator answers ABORTED for a transaction it does not know whose sequence it
has handed out (the decision would be in its log: presumed abort); then this server
writes the ABORT marker itself, with the answering coordinator's epoch, exactly as if
the coordinator had sent it. Any other answer (OPEN, COMMITTING, ABORTING: the
coordinator is on it) or a failure leaves the transaction alone until the next round.

Transactions opened through NewTxn are looked up too (their coordinator aborts them at
their timeout; a lost marker is re-sent): the lookup is cheap and it catches every way
a transaction could be left behind. At most `max_per_round` questions per round.

A transaction whose TC partition changed coordinators since it was first seen open (its
coordinator epoch rose: this server watches `/tc/<k>`) is looked up at the next round
instead of after `check_after`: the coordinator that staged it is gone, so nothing will
decide it but its successor, which answers ABORTED for a one-call transaction it finds
nowhere in its log. A coordinator killed between staging and deciding then holds its
partitions' max read position (and read_committed readers) for its successor's takeover
plus a round, not `check_after` (10 s). Once the successor answers that it knows it
(OPEN, COMMITTING, ...), it is due only as any other is (open for `check_after`); a
refusal (still loading, moved again) leaves it due the next round.
"""

from __future__ import annotations

import asyncio
import logging
import time

from atomlog.v1 import coordinator_pb2

from partition_server.owner import Marker, State
from partition_server.record_batch import ControlType, TxnId
from services.errors import AtomlogError, unexpected
from services.fastmetrics import Counter
from services.logs import event

log = logging.getLogger("atomlog.partition.txn_checker")

PRESUMED_ABORTS = Counter("atomlog_partition_presumed_aborts_total",
                          "Transactions this server aborted itself because their coordinator "
                          "did not know them (one-call transactions that never committed), "
                          "by kind (data, acks).", ["kind"])
CHECKS = Counter("atomlog_partition_txn_checks_total",
                 "Old open transactions looked up at their coordinator, by answer.", ["answer"])

ABORTED = coordinator_pb2.TXN_STATE_ABORTED
# Answers of a coordinator that knows the transaction (it will decide it, or has).
KNOWN = frozenset(("OPEN", "PREPARED", "COMMITTING", "ABORTING", "COMMITTED"))


def due_lookups(first_seen: dict, asked: dict, found, now: float, check_after_s: float,
                max_per_round: int, moved=frozenset()) -> tuple[dict, dict, list]:
    """(when each open transaction in `found` was first seen, kept from `first_seen` or
    `now`; when each was last looked up, `asked` with this round's lookups at `now`; the
    ones this round looks up). Due are those open for `check_after_s` or more, and those
    in `moved` (their coordinator changed since they were first seen); at most
    `max_per_round` of them are looked up, those never asked first, then those asked
    longest ago. So a transaction is looked up within a bounded number of rounds however
    many others stay open and due (before, the same first `max_per_round` were asked
    every round, and one behind them never was). Transactions no longer open are
    forgotten."""
    seen = {key: first_seen.get(key, now) for key in found}
    due = [key for key, first in seen.items() if now - first >= check_after_s or key in moved]
    if len(due) > max_per_round:
        never = float("-inf")
        due.sort(key=lambda key: asked.get(key, never))  # (stable: ties keep their order)
        due = due[:max_per_round]
    asked = {key: asked[key] for key in seen if key in asked}
    asked.update((key, now) for key in due)
    return seen, asked, due


def lookup_outcome(answer) -> tuple[str, int | None]:
    """What a coordinator's answer about an open transaction means here: (the label it is
    counted under, the coordinator epoch to write the ABORT marker with, or None to leave
    the transaction for the next round). `answer`: (TxnState, epoch) or the exception the
    lookup raised. A refusal (an AtomlogError) and a ZooKeeper blip are answers (the
    transaction is looked up again next round: counted, not logged with a traceback each
    time); any other exception is a bug and is raised again, failing the round (logged)."""
    if isinstance(answer, AtomlogError):
        return answer.reason, None
    if isinstance(answer, BaseException):
        failure = unexpected(answer, "looking up an open transaction")
        if failure.reason != "ZOOKEEPER_UNAVAILABLE":
            raise answer
        return failure.reason, None
    state, epoch = answer
    label = coordinator_pb2.TxnState.Name(state).removeprefix("TXN_STATE_")
    return label, (epoch if state == ABORTED else None)


class TxnChecker:
    def __init__(self, manager, verifier, *, check_after_ms: int, interval_ms: int,
                 max_per_round: int = 1_000):
        self.manager = manager
        self.verifier = verifier
        self.check_after_s = check_after_ms / 1000
        self.interval_s = interval_ms / 1000
        self.max_per_round = max_per_round
        # (topic, partition, subscription or None, txn) -> when first seen open, and when
        # last looked up (monotonic)
        self._first_seen: dict[tuple, float] = {}
        self._asked: dict[tuple, float] = {}
        # -> its TC partition's coordinator epoch when first seen (or when its current
        # coordinator last answered about it): a higher one now means a successor
        # (`moved_keys`)
        self._seen_epoch: dict[tuple, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="txn checker")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 — logged; the next round tries again
                log.exception("looking over open transactions failed")

    def _open_now(self) -> dict[tuple, object]:
        """Every open transaction and pending-ack transaction of the ONLINE partitions."""
        found: dict[tuple, object] = {}
        for owner in list(self.manager.owners.values()):
            if owner.state is not State.ONLINE or owner.txns_recovering:
                continue
            for open_txn in owner.txns.describe():
                found[(owner.topic, owner.partition, None, open_txn.txn)] = owner
            for name in owner.subscriptions.names():
                try:
                    pending = owner.subscriptions.pending_transactions(name)
                except AtomlogError:
                    continue  # deleted meanwhile, or the store is reloading
                for txn in pending:
                    found[(owner.topic, owner.partition, name, txn)] = owner
        return found

    def _epoch(self, txn) -> int:
        return self.verifier.epochs.current(txn[0])

    def _moved_keys(self, found: dict) -> set[tuple]:
        """The open transactions in `found` whose TC partition's coordinator epoch rose
        since they were first seen (remembering the epoch of those seen for the first
        time, forgetting those no longer open)."""
        seen_epoch, moved = {}, set()
        for key in found:
            current = self._epoch(key[3])
            before = self._seen_epoch.get(key, current)
            seen_epoch[key] = before
            if current > before:
                moved.add(key)
        self._seen_epoch = seen_epoch
        return moved

    async def check_once(self) -> int:
        """One round; returns how many transactions it aborted."""
        now = time.monotonic()
        found = self._open_now()
        moved = self._moved_keys(found)
        self._first_seen, self._asked, due = due_lookups(
            self._first_seen, self._asked, found, now, self.check_after_s, self.max_per_round,
            moved)
        if not due:
            return 0
        outcomes = await asyncio.gather(*(self._check(key, found[key]) for key in due))
        return sum(outcomes)

    async def _check(self, key: tuple, owner) -> bool:
        topic, partition, subscription, txn = key
        try:
            answer = await self.verifier.state(TxnId(*txn), topic, partition,
                                               subscription=subscription)
        except Exception as error:  # noqa: BLE001 — judged by lookup_outcome
            answer = error
        label, epoch = lookup_outcome(answer)
        CHECKS.labels(label).inc()
        if epoch is None:
            if label in KNOWN and key in self._seen_epoch:
                # Its coordinator (a successor, perhaps) knows it: no longer due for the move.
                self._seen_epoch[key] = self._epoch(txn)
            return False
        try:
            if subscription is None:
                [result] = await owner.end_transactions([Marker(txn, ControlType.ABORT, epoch)])
                if isinstance(result, AtomlogError):
                    raise result
            else:
                owner.verified_acks.pop((txn, subscription), None)
                await owner.subscriptions.end_txn(subscription, txn, False)
        except AtomlogError as error:
            event(log, "presumed abort failed; trying again next round", partition=owner.name,
                  subscription=subscription or "", txn=f"{txn[0]}:{txn[1]}",
                  reason=error.reason)
            return False
        self._first_seen.pop(key, None)
        self._asked.pop(key, None)
        self._seen_epoch.pop(key, None)
        PRESUMED_ABORTS.labels("data" if subscription is None else "acks").inc()
        event(log, "transaction unknown to its coordinator aborted here (presumed abort)",
              partition=owner.name, subscription=subscription or "",
              txn=f"{txn[0]}:{txn[1]}", coordinator_epoch=epoch)
        return True
