"""The decision part of a partition owner's write step: a pure core (no I/O, no clock, no
metrics objects, no asyncio).

`decide` takes one group of queued works (produce and stage works, marker works,
resolutions) and decides every item in queue order against the partition's producer
state, transaction buffer and late-write guard: it appends one result per item to each
work's `results` and changes the three tables as the owner's step always did; it returns
what the shell (PartitionOwner._write) needs to append the accepted batches to the log and
to count them. The caller gives it `now`, the log end (`next_offset`), replication's
too-few refusal (or None), the owner's name (for the errors' messages) and the server's
coordinator-epoch lookup (or None).

This module is the reference. The native core has a twin (partition_server/rust/src/
write_step.rs, `_native.decide_write_step`) with the same signature and results, used by
the owner when its tables are the native core's classes; tests/test_native_write_step.py
holds the two together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from partition_server.producer_state import APPEND
from partition_server.record_batch import (ATTR_TRANSACTIONAL, LENGTH_FIELD_END, BatchHeader,
                                           ControlType, TxnId, control_batch_parsed)
from partition_server.txn_buffer import MarkerAction
from services.errors import AtomlogError


@dataclass(slots=True)
class Appended:
    base_offset: int
    last_offset: int
    log_append_time_ms: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class MarkerResult:
    marker_offset: int  # -1: nothing written
    already_ended: bool


@dataclass(frozen=True, slots=True)
class Marker:
    txn: TxnId
    decision: ControlType
    coordinator_epoch: int


@dataclass
class _Work:
    batches: list[tuple[bytes, BatchHeader]]
    # Per batch: its verification token (transactional ones), None (not verified), or
    # the error its verification failed with: the owner raises it only if the batch is
    # new (a retry of a batch written before is answered as the duplicate it is).
    tokens: list[int | AtomlogError | None] | None
    future: asyncio.Future
    results: list = field(default_factory=list)
    size: int = 0  # bytes of its batches
    # A one-call transaction's staged batch (its coordinator vouches: no verification;
    # deduplicated by transaction: a repeated stage answers the open one's offsets),
    # and the coordinator epoch it was staged with (checked in the write step).
    staged: TxnId | None = None
    stage_epoch: int = 0


@dataclass
class _MarkerWork:
    markers: list[Marker]
    future: asyncio.Future
    results: list = field(default_factory=list)
    size: int = 0  # at most this many bytes of control batches (MARKER_BATCH_BYTES each)


@dataclass
class _ResolveWork:
    """ResolveStaged's question about one transaction: answered in the write step, in
    queue order, and given once the flush covering everything before it has ended."""

    txn: TxnId
    future: asyncio.Future
    results: list = field(default_factory=list)
    size: int = 0  # writes nothing


_Queued = _Work | _MarkerWork | _ResolveWork  # what the owner's queue holds


class Decided(NamedTuple):
    """What `decide` returns: the batches to append (bytes, header) in order with the
    offset each must get, the log end after them, counts for the metrics, the markers
    written per decision, and the offset of the last control batch written (None: none)."""

    accepted: list[tuple[bytes, BatchHeader]]
    expected_bases: list[int]
    next_offset: int
    duplicates: int
    records: int
    appended_bytes: int
    commits_written: int
    aborts_written: int
    last_control_offset: int | None


def verify_again(name: str, txn: TxnId) -> AtomlogError:
    """The retriable refusal of a write whose verification a marker overtook."""
    return AtomlogError(
        "CONCURRENT_TRANSACTIONS",
        f"transaction {txn.tc_partition}:{txn.sequence} changed on {name} while "
        "this write was being verified; retry it (it will be verified again)",
        {"retry_after_ms": "50"})


def current_coordinator_epoch(txns, coordinator_epoch: Callable[[int], int] | None,
                              tc_partition: int) -> int:
    """The epoch below which a stage of the TC partition is stale (see
    PartitionOwner.current_coordinator_epoch)."""
    known = coordinator_epoch(tc_partition) if coordinator_epoch else 0
    return max(known, txns.coordinator_epochs().get(tc_partition, 0))


def check_stage_epoch(name: str, txns, coordinator_epoch: Callable[[int], int] | None,
                      txn: TxnId, epoch: int, what: str = "stage") -> None:
    """Raise STALE_COORDINATOR_EPOCH (see PartitionOwner.check_stage_epoch)."""
    current = current_coordinator_epoch(txns, coordinator_epoch, txn.tc_partition)
    if epoch < current:
        raise stale_epoch(name, txn, epoch, current, what)


def stale_epoch(name: str, txn: TxnId, epoch: int, current: int,
                what: str = "stage") -> AtomlogError:
    """STALE_COORDINATOR_EPOCH of a stage of `txn` at `epoch` below `current`."""
    return AtomlogError(
        "STALE_COORDINATOR_EPOCH",
        f"{what} of {txn.tc_partition}:{txn.sequence} on {name} has "
        f"coordinator epoch {epoch}; the current one of TC partition "
        f"{txn.tc_partition} is {current}",
        {"tc_partition": txn.tc_partition, "coordinator_epoch": epoch,
         "current_coordinator_epoch": current})


def decide(group: list, now: int, next_offset: int, too_few: AtomlogError | None,
           producers, txns, guard, name: str,
           coordinator_epoch: Callable[[int], int] | None) -> Decided:
    """Decide one group (see the module doc). Too few in-sync replicas (`too_few`): new
    batches are refused with it (nothing written), retries of written ones still answered
    as duplicates, so a refusal always means "not in the log"."""
    accepted: list[tuple[bytes, BatchHeader]] = []
    expected_bases: list[int] = []
    check, apply = producers.check, producers.apply
    duplicates = records = appended_bytes = 0
    written = {ControlType.COMMIT: 0, ControlType.ABORT: 0}
    last_control = None
    for work in group:
        results = work.results
        if isinstance(work, _MarkerWork):
            for marker in work.markers:
                try:
                    framed = _marker(producers, txns, guard, marker, next_offset, now,
                                     results)
                except AtomlogError as error:
                    results.append(error)
                    continue
                if framed is not None:
                    last_control = next_offset
                    written[marker.decision] += 1
                    accepted.append(framed)
                    expected_bases.append(next_offset)
                    next_offset += 1
            continue
        if isinstance(work, _ResolveWork):
            results.append(_staged_here(txns, work.txn))
            continue
        if work.staged is not None:
            refusal = _check_stage(txns, name, coordinator_epoch, work.staged,
                                   work.stage_epoch)
            if refusal is not None:
                results.append(refusal)
                continue
        tokens = work.tokens
        for index, item in enumerate(work.batches):
            header = item[1]
            try:
                decision = check(header.producer_id, header.producer_epoch,
                                 header.base_sequence, header.record_count, now)
                if (decision is APPEND and header.attributes & ATTR_TRANSACTIONAL
                        and work.staged is None):
                    _check_transactional(txns, guard, name, header,
                                         tokens[index] if tokens else None)
            except AtomlogError as error:
                results.append(error)
                continue
            if decision is APPEND and too_few is not None:
                results.append(too_few)
                continue
            if decision is APPEND:
                last = next_offset + header.last_offset_delta
                apply(header.producer_id, header.producer_epoch, header.base_sequence,
                      header.last_sequence, next_offset, last, now,
                      control=header.is_control)
                if header.attributes & ATTR_TRANSACTIONAL:
                    txns.on_data(header.txn, header.producer_id, header.producer_epoch,
                                 next_offset, last, now)
                results.append(Appended(next_offset, last, now))
                accepted.append(item)
                expected_bases.append(next_offset)
                records += header.record_count
                appended_bytes += header.batch_length + LENGTH_FIELD_END
                next_offset = last + 1
            else:
                duplicates += 1
                results.append(Appended(decision.base_offset, decision.last_offset,
                                        decision.timestamp_ms, duplicate=True))
    return Decided(accepted, expected_bases, next_offset, duplicates, records, appended_bytes,
                   written[ControlType.COMMIT], written[ControlType.ABORT], last_control)


def _check_transactional(txns, guard, name: str, header: BatchHeader,
                         token: int | AtomlogError | None) -> None:
    """A transactional data batch about to be appended (not a retry of one written
    before: those are answered as duplicates whatever became of their transaction):
    its transaction is open here already, or was verified with the coordinator with no
    marker for it since (txn_guard.py); then the buffer's own checks. Raises; changes
    nothing."""
    if isinstance(token, AtomlogError):
        raise token  # its verification failed
    txn = header.txn
    if txns.open_transaction(txn) is None and (
            token is None or not guard.allows(txn, token)):
        raise verify_again(name, txn)
    txns.check_write(txn, header.producer_id, header.producer_epoch)


def _check_stage(txns, name: str, coordinator_epoch, txn: TxnId,
                 epoch: int) -> Appended | AtomlogError | None:
    """A staged batch in the write step: the open transaction's offsets (a repeated
    stage: already in the log), a refusal (its coordinator epoch is stale, or the
    buffer refuses the write), or None: append it. Changes nothing."""
    try:
        existing = txns.open_transaction(txn)
        if existing is not None:
            return Appended(existing.first_offset, existing.last_offset,
                            existing.first_timestamp_ms, duplicate=True)
        check_stage_epoch(name, txns, coordinator_epoch, txn, epoch)
        txns.check_write(txn, 0, 0)
    except AtomlogError as error:
        return error
    return None


def _staged_here(txns, txn: TxnId) -> bool | AtomlogError:
    """ResolveStaged's answer as of this point of the write step."""
    try:
        if txns.open_transaction(txn) is not None:
            return True
        ended = txns.ended(txn)
    except AtomlogError as error:  # the buffer is replaying
        return error
    return ended is not None and ended[0] is ControlType.COMMIT


def _marker(producers, txns, guard, marker: Marker, offset: int, now: int,
            results: list) -> tuple[bytes, BatchHeader] | None:
    """Decide one marker; append its result; return the control batch to write at
    `offset` with its header, or None."""
    plan = txns.check_marker(marker.txn, marker.decision, marker.coordinator_epoch)
    guard.on_marker(marker.txn)
    if plan.action is not MarkerAction.WRITE:
        results.append(MarkerResult(-1, plan.already_ended))
        return None
    framed = control_batch_parsed(marker.decision, txn=marker.txn,
                                  coordinator_epoch=marker.coordinator_epoch,
                                  timestamp_ms=now, producer_id=plan.producer_id,
                                  producer_epoch=plan.producer_epoch)
    producers.apply(plan.producer_id, plan.producer_epoch, -1, -1, offset, offset, now,
                    control=True)
    txns.on_marker(marker.txn, marker.decision, marker.coordinator_epoch, offset)
    results.append(MarkerResult(offset, False))
    return framed
