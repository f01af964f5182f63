"""The subscription-cursor core (partition_server/subscription_cursor.py).

Scripted tests cover each rule, each refusal (and that it changes nothing), the bounds,
deliveries, the entry and snapshot formats. A Hypothesis state machine then drives one
cursor with random plain and transactional acks, markers, deliveries to several
consumers, Nacks, time, retention, resets, snapshots, syncs and crashes (losing the
journal tail that was not synced), against a model made of plain sets: the acknowledged
offsets, the offsets each open transaction claims, the offsets out to each consumer.
After every step: the cursor equals the model (its next delivery deadline included), and
snapshot + journal replay + forget_below(log start) equals the live durable state.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from partition_server.record_batch import TxnId
from partition_server.snapshot_files import seal
from partition_server.subscription_cursor import (
    SNAPSHOT_VERSION,
    Acked,
    Created,
    CursorLimits,
    CursorState,
    Deleted,
    EntryCorrupt,
    InitialPosition,
    OffsetRange,
    PendingAck,
    Reset,
    SnapshotCorrupt,
    SubscriptionCursor,
    Truncated,
    TxnEnded,
    decode_entry,
    decode_snapshot,
    encode_entry,
    encode_snapshot,
    plan_create,
    resolve_initial_position,
)
from services.errors import REASONS, AtomlogError

T1, T2, T3 = TxnId(1, 1), TxnId(1, 2), TxnId(2, 1)
R = OffsetRange


def refused(call, *args, **kwargs) -> AtomlogError:
    with pytest.raises(AtomlogError) as info:
        call(*args, **kwargs)
    assert info.value.reason in REASONS
    return info.value


def ack(cursor: SubscriptionCursor, cumulative_end: int = 0, ranges=(), txn=None,
        limit: int = 1_000) -> Acked | None:
    entry = cursor.check_ack(cumulative_end, ranges, txn, limit=limit)
    if entry is not None:
        assert decode_entry(encode_entry(entry)) == entry
        cursor.apply(entry)
    return entry


def end(cursor: SubscriptionCursor, txn: TxnId, committed: bool) -> bool:
    plan = cursor.plan_end_txn(txn, committed)
    if plan.entry is not None:
        cursor.apply(plan.entry)
    return plan.already_ended


def unchanged(cursor: SubscriptionCursor, call, *args, **kwargs) -> AtomlogError:
    before = cursor.state()
    error = refused(call, *args, **kwargs)
    assert cursor.state() == before
    return error


def deliver(cursor, consumer, log_end, now_ms=0, markers=(), max_offsets=100,
            ack_timeout_ms=1_000, apply_skip=True):
    plan = cursor.read_plan(now_ms, max_offsets)
    scanned = list(plan.redeliver) + ([(plan.new_from, log_end)]
                                      if plan.new_allowed and plan.new_from < log_end else [])
    readable = []
    for start, end_ in scanned:
        readable += [(o, o + 1) for o in range(start, end_) if o not in markers]
    delivery = cursor.next_delivery(consumer, readable, scanned, now_ms, ack_timeout_ms,
                                    max_offsets)
    if apply_skip and delivery.skip is not None:
        cursor.apply(delivery.skip)
    return delivery


# ---------------------------------------------------------------------------------------
# Plain acks
# ---------------------------------------------------------------------------------------

def test_individual_acks_compact_into_the_cumulative_end():
    cursor = SubscriptionCursor(10)
    ack(cursor, ranges=[(12, 14), (16, 17)])
    assert cursor.cumulative_end == 10
    assert cursor.individual_ranges() == (R(12, 14), R(16, 17))
    ack(cursor, ranges=[(10, 12)])  # touches the cumulative end: the cursor advances
    assert cursor.cumulative_end == 14 and cursor.individual_ranges() == (R(16, 17),)
    ack(cursor, ranges=[(14, 15), (15, 16)])  # adjacent request ranges merge
    assert cursor.cumulative_end == 17 and cursor.individual_ranges() == ()
    assert cursor.is_acknowledged(16) and not cursor.is_acknowledged(17)


def test_what_was_delivered_past_the_max_read_position_can_be_acknowledged():
    """A READ_UNCOMMITTED reader is given offsets up to the high watermark, past the max
    read position while a transaction is open. Its acks of them were refused
    (OFFSET_OUT_OF_RANGE: the limit was the max read position), and they came back every
    ack timeout until the transaction ended. Now the limit is the max read position or
    the end of what was delivered, whichever is further; beyond both is still refused."""
    cursor = SubscriptionCursor()
    assert [tuple(r) for r in deliver(cursor, "c", log_end=12).delivered] == [(0, 12)]
    assert ack(cursor, ranges=[(11, 12)], limit=10) is not None  # the MRP is 10
    assert ack(cursor, cumulative_end=12, limit=10) is not None
    assert cursor.cumulative_end == 12
    error = unchanged(cursor, cursor.check_ack, ranges=[(12, 13)], limit=10)
    assert error.reason == "OFFSET_OUT_OF_RANGE"


def test_cumulative_acks_and_repeats_are_no_ops_that_succeed():
    cursor = SubscriptionCursor()
    entry = ack(cursor, cumulative_end=5, ranges=[(7, 8)])
    assert entry == Acked(None, 5, (R(7, 8),))
    assert ack(cursor, cumulative_end=3) is None  # backwards: a no-op
    assert ack(cursor, ranges=[(7, 8), (2, 4)]) is None  # all acknowledged already
    assert ack(cursor, cumulative_end=7) is not None  # 7 was acknowledged: on to 8
    assert cursor.cumulative_end == 8
    assert cursor.metrics.noop_acks_total == 2


def test_invalid_acks_are_refused_and_change_nothing():
    cursor = SubscriptionCursor()
    ack(cursor, ranges=[(4, 5)])
    cases = [
        ({}, "INVALID_ARGUMENT"),                                   # neither kind of ack
        ({"ranges": [(3, 3)]}, "INVALID_ARGUMENT"),                 # empty range
        ({"ranges": [(-1, 2)]}, "INVALID_ARGUMENT"),
        ({"cumulative_end": -2}, "INVALID_ARGUMENT"),
        ({"ranges": [(1, 2)], "txn": TxnId(0, 0)}, "INVALID_ARGUMENT"),
        ({"ranges": [(8, 11)]}, "OFFSET_OUT_OF_RANGE"),              # at the limit 10
        ({"cumulative_end": 11}, "OFFSET_OUT_OF_RANGE"),
    ]
    for kwargs, reason in cases:
        error = unchanged(cursor, cursor.check_ack, limit=10, **kwargs)
        assert error.reason == reason, (kwargs, error)
    small = SubscriptionCursor(0, CursorLimits(max_ranges=5))  # more ranges than the table
    error = unchanged(small, small.check_ack, ranges=[(1, 2)] * 6, limit=10)
    assert (error.reason, error.metadata["limit"]) == ("INVALID_ARGUMENT",
                                                       "subscription.max_ranges")
    error = refused(cursor.check_ack, ranges=[(8, 11)], limit=10)
    assert error.metadata == {"field": "individual_ranges", "max_read_position": "10"}
    assert ack(cursor, cumulative_end=10, limit=10) is not None  # up to the limit is fine


# ---------------------------------------------------------------------------------------
# Transactional acks
# ---------------------------------------------------------------------------------------

def test_pending_acks_conflict_with_other_transactions_and_plain_acks():
    cursor = SubscriptionCursor()
    ack(cursor, ranges=[(5, 8)], txn=T1)
    assert cursor.pending_acks() == (PendingAck(T1, 0, (R(5, 8),)),)
    assert cursor.cumulative_end == 0  # a pending ack moves nothing
    error = unchanged(cursor, cursor.check_ack, ranges=[(7, 9)], txn=T2, limit=100)
    assert error.reason == "TRANSACTION_CONFLICT"
    assert error.metadata == {"txn_id": "(1, 1)", "start_offset": "7", "end_offset": "8"}
    assert "pending in transaction (1, 1) (acked by transaction (1, 2))" in error.message
    error = unchanged(cursor, cursor.check_ack, ranges=[(6, 7)], limit=100)
    assert error.reason == "TRANSACTION_CONFLICT"
    # A plain cumulative ack across the pending offsets conflicts too.
    assert unchanged(cursor, cursor.check_ack, 10, limit=100).reason == "TRANSACTION_CONFLICT"
    ack(cursor, cumulative_end=5)  # below them: fine
    ack(cursor, ranges=[(8, 9)], txn=T2)  # touching, not overlapping: fine
    assert ack(cursor, ranges=[(5, 6)], txn=T1) is None  # T1 repeats itself: a no-op
    assert cursor.metrics.conflicts_total == 3


def test_a_pending_cumulative_ack_claims_everything_unacknowledged_below_it():
    cursor = SubscriptionCursor()
    ack(cursor, ranges=[(2, 3)])
    ack(cursor, ranges=[(6, 7)], txn=T2)
    error = unchanged(cursor, cursor.check_ack, 8, txn=T1, limit=100)
    assert error.reason == "TRANSACTION_CONFLICT"  # T2's offset 6 is below 8
    ack(cursor, cumulative_end=5, txn=T1)
    assert cursor.pending_acks()[0] == PendingAck(T1, 5, ())
    # At most one transaction holds a pending cumulative ack; offsets it claims are taken.
    assert unchanged(cursor, cursor.check_ack, 7, txn=T3, limit=100).reason == \
        "TRANSACTION_CONFLICT"
    assert unchanged(cursor, cursor.check_ack, ranges=[(4, 5)], txn=T3, limit=100).reason \
        == "TRANSACTION_CONFLICT"
    assert unchanged(cursor, cursor.check_ack, ranges=[(3, 4)], limit=100).reason == \
        "TRANSACTION_CONFLICT"
    assert ack(cursor, ranges=[(2, 3)]) is None  # acknowledged before: still a no-op
    assert ack(cursor, cumulative_end=4, txn=T1) is None  # below T1's own: a no-op
    ack(cursor, ranges=[(5, 6)], txn=T3)
    end(cursor, T1, committed=True)
    assert cursor.cumulative_end == 5 and cursor.individual_ranges() == ()


def test_transactional_ack_of_acknowledged_offsets_conflicts():
    """Exactly once: a transaction must not commit consuming a message consumed before."""
    cursor = SubscriptionCursor()
    ack(cursor, cumulative_end=3, ranges=[(5, 6)])
    for kwargs in ({"ranges": [(5, 6)]}, {"ranges": [(4, 6)]}, {"cumulative_end": 3},
                   {"cumulative_end": 2}):
        error = unchanged(cursor, cursor.check_ack, txn=T1, limit=100, **kwargs)
        assert error.reason == "TRANSACTION_CONFLICT" and "already acknowledged" in \
            error.message
    ack(cursor, cumulative_end=5, txn=T1)  # claims only the unacknowledged 3 and 4
    end(cursor, T1, committed=True)
    assert cursor.cumulative_end == 6


def test_commit_applies_abort_releases_for_redelivery_at_once():
    cursor = SubscriptionCursor()
    first = deliver(cursor, "a", log_end=6)
    assert first.delivered == (R(0, 6),) and first.redelivered == ()
    ack(cursor, ranges=[(4, 6)], txn=T1)
    ack(cursor, cumulative_end=3, txn=T2)
    assert cursor.describe(6, 0).delivered_unacknowledged_count == 1  # only 3 is out
    end(cursor, T1, committed=False)
    again = deliver(cursor, "b", log_end=6, now_ms=1)
    assert again.delivered == again.redelivered == (R(4, 6),)
    end(cursor, T2, committed=True)
    assert cursor.cumulative_end == 3 and cursor.pending_acks() == ()
    ack(cursor, ranges=[(3, 6)])
    assert cursor.cumulative_end == 6
    assert cursor.metrics.commits_total == 1 and cursor.metrics.aborts_total == 1


def test_markers_repeat_conflict_tombstone_and_late_acks():
    cursor = SubscriptionCursor(0, CursorLimits(max_remembered_transactions=2))
    ack(cursor, ranges=[(1, 2)], txn=T1)
    assert end(cursor, T1, committed=True) is False
    assert end(cursor, T1, committed=True) is True  # repeated marker: already ended
    assert cursor.plan_end_txn(T1, True).entry is None
    error = unchanged(cursor, cursor.plan_end_txn, T1, False)
    assert error.reason == "TRANSACTION_ALREADY_COMMITTED"
    # A marker for a transaction never seen here leaves a tombstone: an ack of it that
    # raced the marker cannot hang as a pending ack forever.
    plan = cursor.plan_end_txn(T2, False)
    assert plan == type(plan)(TxnEnded(T2, False), already_ended=False)
    cursor.apply(plan.entry)
    error = unchanged(cursor, cursor.check_ack, ranges=[(3, 4)], txn=T2, limit=100)
    assert (error.reason, error.metadata) == ("TRANSACTION_NOT_OPEN", {"txn_id": "(1, 2)"})
    assert unchanged(cursor, cursor.plan_end_txn, T2, True).reason == "TRANSACTION_ABORTED"
    end(cursor, T3, committed=True)  # bound of 2: T1 is forgotten
    assert [txn for txn, _ in cursor.state().ended] == [T2, T3]
    assert end(cursor, T1, committed=False) is False
    assert cursor.metrics.late_acks_total == 1


def test_reset_and_delete_are_refused_with_pending_acks():
    cursor = SubscriptionCursor(5)
    ack(cursor, ranges=[(7, 8)])
    ack(cursor, ranges=[(9, 10)], txn=T1)
    assert unchanged(cursor, cursor.plan_reset, 2).reason == "TRANSACTION_CONFLICT"
    assert unchanged(cursor, cursor.plan_delete).reason == "TRANSACTION_CONFLICT"
    end(cursor, T1, committed=False)
    deliver(cursor, "a", log_end=12)
    cursor.apply(cursor.plan_reset(2))  # backwards: everything from 2 is unacknowledged
    assert cursor.state() == CursorState(2, (), (), ((T1, False),))
    assert cursor.read_position == 2 and cursor.describe(12, 0).delivered_unacknowledged_count \
        == 0
    cursor.apply(cursor.plan_delete())
    assert cursor.deleted


def test_a_data_loss_cuts_acks_pending_acks_and_deliveries_back_to_the_new_log_end():
    """RecoverPartition cut the log back to 6: the messages written at 6.. next are new,
    so nothing acknowledged, claimed or handed out there before may stand for them."""
    cursor = SubscriptionCursor(4)
    ack(cursor, ranges=[(5, 6), (8, 9)])
    ack(cursor, cumulative_end=10, txn=T1)
    ack(cursor, ranges=[(11, 12)], txn=T2)
    deliver(cursor, "a", log_end=12)
    assert cursor.plan_truncate(12) is None  # nothing above a log end of 12
    entry = cursor.plan_truncate(6)
    assert entry == Truncated(6) and decode_entry(encode_entry(entry)) == entry
    cursor.apply(entry)
    assert cursor.state() == CursorState(4, (R(5, 6),), ((T1, 6, ()), (T2, 0, ())), ())
    assert cursor.read_position == 6
    assert cursor.describe(6, 0).delivered_unacknowledged_count == 0
    # A new message at 8 is delivered (the old ack of 8 is gone), and T1's commit
    # acknowledges what it claimed below the cut only.
    end(cursor, T1, committed=True)
    assert cursor.cumulative_end == 6
    assert sorted(offsets_of(deliver(cursor, "b", log_end=9).delivered)) == [6, 7, 8]
    assert cursor.plan_truncate(9) is None


# ---------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------

def test_range_table_bound_refuses_growth_only():
    cursor = SubscriptionCursor(0, CursorLimits(max_ranges=3))
    ack(cursor, ranges=[(2, 3), (4, 5)])
    ack(cursor, ranges=[(6, 7)], txn=T1)  # pending ranges count too
    error = unchanged(cursor, cursor.check_ack, ranges=[(8, 9)], limit=100)
    assert (error.reason, error.metadata["limit"]) == ("RESOURCE_EXHAUSTED",
                                                       "subscription.max_ranges")
    assert unchanged(cursor, cursor.check_ack, ranges=[(8, 9)], txn=T2,
                     limit=100).reason == "RESOURCE_EXHAUSTED"
    ack(cursor, ranges=[(3, 4)])  # fills a hole: the table shrinks
    ack(cursor, ranges=[(7, 8)], txn=T1)  # extends T1's range: no growth
    ack(cursor, ranges=[(0, 1)])  # compacts into the cumulative end
    assert cursor.range_count == 2
    end(cursor, T1, committed=True)  # a commit never exceeds: its ranges were counted
    assert cursor.range_count == 2 and cursor.metrics.exhausted_total == 2


def test_pending_transaction_bound():
    cursor = SubscriptionCursor(0, CursorLimits(max_pending_transactions=2))
    ack(cursor, ranges=[(0, 1)], txn=T1)
    ack(cursor, ranges=[(1, 2)], txn=T2)
    error = unchanged(cursor, cursor.check_ack, ranges=[(2, 3)], txn=T3, limit=100)
    assert (error.reason, error.metadata) == ("RESOURCE_EXHAUSTED",
                                              {"limit": "subscription.max_pending_transactions"})
    ack(cursor, ranges=[(2, 3)], txn=T2)  # open ones go on
    end(cursor, T1, committed=False)
    ack(cursor, ranges=[(3, 4)], txn=T3)


def test_unacked_bound_stops_new_deliveries_but_not_redeliveries():
    cursor = SubscriptionCursor(0, CursorLimits(max_unacked_offsets=4))
    assert deliver(cursor, "a", log_end=20).delivered == (R(0, 4),)
    assert deliver(cursor, "b", log_end=20).delivered == ()
    assert not cursor.read_plan(0, 10).new_allowed
    # Timed out: redelivered, still no new ones.
    assert deliver(cursor, "b", log_end=20, now_ms=1_000).redelivered == (R(0, 4),)
    ack(cursor, ranges=[(0, 2)])
    assert deliver(cursor, "b", log_end=20, now_ms=1_001).delivered == (R(4, 6),)


def test_full_range_table_stops_new_deliveries():
    cursor = SubscriptionCursor(0, CursorLimits(max_ranges=2))
    deliver(cursor, "a", log_end=10, max_offsets=6)
    ack(cursor, ranges=[(1, 2), (3, 4)])
    assert not cursor.read_plan(0, 10).new_allowed
    assert deliver(cursor, "a", log_end=10).delivered == ()
    ack(cursor, ranges=[(0, 1)])
    assert deliver(cursor, "a", log_end=10).delivered == (R(6, 10),)


# ---------------------------------------------------------------------------------------
# Deliveries
# ---------------------------------------------------------------------------------------

def test_shared_delivery_timeouts_and_lowest_first_redelivery():
    cursor = SubscriptionCursor(3)
    assert deliver(cursor, "a", log_end=8, max_offsets=3).delivered == (R(3, 6),)
    assert deliver(cursor, "b", log_end=8).delivered == (R(6, 8),)  # never the same twice
    assert cursor.next_deadline_ms() == 1_000
    assert deliver(cursor, "c", log_end=8, now_ms=999).delivered == ()
    ack(cursor, ranges=[(4, 5)])
    redelivery = deliver(cursor, "c", log_end=10, now_ms=1_000, max_offsets=2)
    assert redelivery.delivered == redelivery.redelivered == (R(3, 4), R(5, 6))
    nxt = deliver(cursor, "c", log_end=10, now_ms=1_000)
    assert (nxt.delivered, nxt.redelivered) == ((R(6, 10),), (R(6, 8),))
    description = cursor.describe(10, 1_000)
    assert (description.delivered_unacknowledged_count, description.redelivery_backlog_count,
            description.backlog_records, description.read_position) == (6, 0, 6, 10)
    assert cursor.metrics.expired_offsets_total == 4


def test_markers_are_skipped_by_an_ack_and_never_delivered():
    cursor = SubscriptionCursor()
    delivery = deliver(cursor, "a", log_end=10, markers={3, 4, 9}, apply_skip=False)
    assert delivery.delivered == (R(0, 3), R(5, 9))
    assert delivery.skip == Acked(None, 0, (R(3, 5), R(9, 10)))
    assert delivery.read_position == 10
    cursor.apply(delivery.skip)
    ack(cursor, ranges=[(0, 3), (5, 9)])
    assert cursor.cumulative_end == 10 and cursor.individual_ranges() == ()
    assert cursor.metrics.skipped_offsets_total == 3


def test_skips_within_the_range_bound_cut_the_read_position():
    cursor = SubscriptionCursor(0, CursorLimits(max_ranges=2))
    delivery = deliver(cursor, "a", log_end=12, markers={1, 3, 5, 7}, apply_skip=False)
    assert delivery.skip.ranges == (R(1, 2), R(3, 4))
    assert delivery.delivered == (R(0, 1), R(2, 3), R(4, 5)) and delivery.read_position == 5


def test_nack_with_delay_all_and_release():
    cursor = SubscriptionCursor()
    deliver(cursor, "a", log_end=6, max_offsets=4)
    deliver(cursor, "b", log_end=6)
    assert cursor.nack("a", [(1, 2), (5, 6)], now_ms=10, delay_ms=100) == 1  # 5 is b's
    assert cursor.next_deadline_ms() == 110
    assert deliver(cursor, "c", log_end=6, now_ms=50).delivered == ()
    assert cursor.describe(6, 50).redelivery_backlog_count == 1
    assert deliver(cursor, "c", log_end=6, now_ms=110).redelivered == (R(1, 2),)
    assert cursor.nack("a", None, now_ms=110, delay_ms=0) == 3  # all of a's: 0, 2, 3
    assert cursor.release_consumer("b") == 2
    assert deliver(cursor, "d", log_end=6, now_ms=111).redelivered == (R(0, 1), R(2, 6))
    assert cursor.metrics.nacked_offsets_total == 4
    assert refused(cursor.nack, "", None, 0, 0).reason == "INVALID_ARGUMENT"


def test_retention_acknowledges_what_it_deleted():
    cursor = SubscriptionCursor()
    deliver(cursor, "a", log_end=10)
    ack(cursor, ranges=[(6, 7)])
    ack(cursor, ranges=[(8, 9)], txn=T1)
    ack(cursor, cumulative_end=5, txn=T2)
    cursor.forget_below(6)
    assert cursor.cumulative_end == 7  # 6 was acknowledged before, 7 is not
    assert cursor.pending_acks() == (PendingAck(T1, 0, (R(8, 9),)), PendingAck(T2, 0, ()))
    assert cursor.describe(10, 0).delivered_unacknowledged_count == 2  # 7 and 9
    cursor.forget_below(3)  # never backwards
    assert cursor.cumulative_end == 7


def test_a_transaction_s_ack_repeated_after_retention_passed_it_is_a_no_op():
    """A transactional ack applied, its answer lost, and retention moved the log start
    past its offsets (taking them out of the pending acks) before the client's retry:
    the retry was refused TRANSACTION_CONFLICT ("already acknowledged, consumed before"),
    though it was the transaction's own ack, standing. Now a no-op, as any repeat is."""
    cursor = SubscriptionCursor()
    deliver(cursor, "a", log_end=40)
    ack(cursor, ranges=[(10, 20)], txn=T1)
    ack(cursor, cumulative_end=8, txn=T2)
    assert ack(cursor, ranges=[(10, 20)], txn=T1) is None  # a repeat: no-op
    cursor.forget_below(30)
    assert ack(cursor, ranges=[(10, 20)], txn=T1) is None
    assert ack(cursor, cumulative_end=8, txn=T2) is None
    assert ack(cursor, ranges=[(12, 15)], txn=T1) is None
    # Another transaction's ack of those offsets still conflicts.
    assert refused(ack, cursor, ranges=[(10, 20)], txn=T3).reason == "TRANSACTION_CONFLICT"


def test_initial_positions():
    assert resolve_initial_position(InitialPosition.EARLIEST, 0, 10, 20) == 10
    assert resolve_initial_position(InitialPosition.LATEST, 0, 10, 20) == 20
    assert [resolve_initial_position(InitialPosition.OFFSET, o, 10, 20)
            for o in (5, 15, 25)] == [10, 15, 20]
    assert plan_create(7) == Created(7)
    assert refused(plan_create, -1).reason == "INVALID_ARGUMENT"


# ---------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------

ENTRIES = [Created(0), Created(12), Deleted(), Reset(3), Acked(None, 5, ()),
           Acked(T1, 0, (R(1, 2), R(4, 9))), Acked(TxnId(7, 2**64 - 1), 9, (R(10, 11),)),
           TxnEnded(T2, True), TxnEnded(T3, False)]


@pytest.mark.parametrize("entry", ENTRIES)
def test_entries_round_trip(entry):
    assert decode_entry(encode_entry(entry)) == entry


@pytest.mark.parametrize("data", [
    b"", b"\x09", b"\x01\x00", encode_entry(Created(1)) + b"\x00",
    encode_entry(Acked(T1, 0, (R(1, 2),)))[:-1],
    b"\x01" + struct.pack("<q", -1),
    b"\x04" + struct.pack("<IQqI", 0, 0, 0, 0),                       # an empty ack
    b"\x04" + struct.pack("<IQqIqq", 0, 0, 0, 1, 5, 5),              # an empty range
    b"\x04" + struct.pack("<IQqIqqqq", 0, 0, 0, 2, 1, 3, 3, 4),      # touching ranges
    b"\x05" + struct.pack("<IQB", 0, 0, 1),                          # no transaction
    b"\x05" + struct.pack("<IQB", 1, 1, 2),
])
def test_corrupt_entries_are_refused(data):
    with pytest.raises(EntryCorrupt):
        decode_entry(data)


def busy_cursor() -> SubscriptionCursor:
    cursor = SubscriptionCursor(4)
    ack(cursor, ranges=[(6, 8), (10, 11)])
    ack(cursor, cumulative_end=9, txn=T1)
    ack(cursor, ranges=[(12, 14)], txn=T2)
    end(cursor, T3, committed=True)
    return cursor


def test_snapshot_round_trip_restores_durable_state_only():
    cursor = busy_cursor()
    deliver(cursor, "a", log_end=20)
    restored = SubscriptionCursor.restore(cursor.snapshot())
    assert restored.state() == cursor.state()
    assert restored.read_position == 4 and restored.describe(20, 0).delivered_unacknowledged_count \
        == 0
    assert decode_snapshot(SubscriptionCursor().snapshot()) == CursorState(0, (), (), ())


def test_every_bit_flip_and_truncation_is_detected():
    data = busy_cursor().snapshot()
    for index in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            with pytest.raises(SnapshotCorrupt):
                decode_snapshot(bytes(flipped))
    for size in range(len(data)):
        with pytest.raises(SnapshotCorrupt):
            decode_snapshot(data[:size])


def _sealed(cumulative_end, ranges, pending, ended, version=SNAPSHOT_VERSION) -> bytes:
    parts = [struct.pack("<4sHHqIII", b"ALSC", version, 0, cumulative_end, len(ranges),
                         len(pending), len(ended))]
    parts += [struct.pack("<qq", *r) for r in ranges]
    for (tc, seq), pending_end, own in pending:
        parts.append(struct.pack("<IQqI", tc, seq, pending_end, len(own)))
        parts += [struct.pack("<qq", *r) for r in own]
    parts += [struct.pack("<IQB", tc, seq, committed) for (tc, seq), committed in ended]
    return seal(b"".join(parts))


@pytest.mark.parametrize("state", [
    (5, [(5, 6)], [], []),                          # a range touching the cumulative end
    (0, [(3, 5), (5, 6)], [], []),                  # touching ranges
    (0, [(3, 2)], [], []),
    (0, [], [((1, 2), 0, [(3, 4)]), ((1, 1), 0, [(5, 6)])], []),  # txns out of order
    (0, [(3, 4)], [((1, 1), 0, [(3, 4)])], []),     # pending an acknowledged offset
    (0, [], [((1, 1), 0, [(3, 5)]), ((1, 2), 0, [(4, 6)])], []),  # claimed twice
    (4, [], [((1, 1), 3, [])], []),                 # pending cumulative below the cursor
    (0, [], [((1, 1), 5, []), ((1, 2), 6, [])], []),              # two cumulative holders
    (0, [], [((1, 1), 5, []), ((1, 2), 0, [(3, 4)])], []),        # inside the other's claim
    (0, [], [((0, 0), 0, [(3, 4)])], []),           # no transaction
    (0, [], [((1, 1), 0, [(3, 4)])], [((1, 1), 1)]),  # both pending and ended
    (0, [], [], [((1, 1), 1), ((1, 1), 0)]),        # ended twice
    (0, [], [], [((1, 1), 2)]),
])
def test_well_sealed_but_invalid_snapshots_are_refused(state):
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(_sealed(*state))


def test_snapshot_version_is_checked():
    assert decode_snapshot(_sealed(3, [(5, 6)], [], [])) == CursorState(3, (R(5, 6),), (), ())
    with pytest.raises(SnapshotCorrupt, match="version"):
        decode_snapshot(_sealed(3, [], [], [], version=2))


def test_encode_snapshot_pair_checks_its_output():
    state = busy_cursor().state()
    assert decode_snapshot(encode_snapshot(state)) == state


# ---------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------

LIMITS = CursorLimits(max_ranges=3, max_pending_transactions=2, max_unacked_offsets=10,
                      max_remembered_transactions=3)
TXNS = [TxnId(1, n) for n in range(1, 9)]
CONSUMERS = ["a", "b", "c"]
LOG_MAX = 40
TIMEOUT_MS = 100


def runs(offsets) -> tuple[OffsetRange, ...]:
    result: list[list[int]] = []
    for offset in sorted(offsets):
        if result and result[-1][1] == offset:
            result[-1][1] += 1
        else:
            result.append([offset, offset + 1])
    return tuple(R(s, e) for s, e in result)


def offsets_of(ranges) -> set[int]:
    return {o for s, e in ranges for o in range(s, e)}


class Model:
    """The durable state as sets."""

    def __init__(self, cumulative_end: int = 0) -> None:
        self.acked: set[int] = set(range(cumulative_end))
        self.pending: dict[TxnId, list] = {}  # txn -> [cumulative end, offsets]
        self.ended: OrderedDict[TxnId, bool] = OrderedDict()
        self.log_start = 0  # what retention deleted below (not durable: re-applied)

    def copy(self) -> Model:
        other = Model()
        other.log_start = self.log_start
        other.acked = set(self.acked)
        other.pending = {txn: [c, set(r)] for txn, (c, r) in self.pending.items()}
        other.ended = OrderedDict(self.ended)
        return other

    @property
    def cumulative_end(self) -> int:
        offset = 0
        while offset in self.acked:
            offset += 1
        return offset

    def individual(self, acked=None) -> tuple[OffsetRange, ...]:
        acked = self.acked if acked is None else acked
        cumulative_end = 0
        while cumulative_end in acked:
            cumulative_end += 1
        return runs(o for o in acked if o > cumulative_end)

    def claims(self, except_txn=None) -> set[int]:
        cumulative_end, claimed = self.cumulative_end, set()
        for txn, (pending_end, own) in self.pending.items():
            if txn != except_txn:
                claimed |= own | (set(range(cumulative_end, pending_end)) - self.acked)
        return claimed

    def range_count(self) -> int:
        return len(self.individual()) + sum(len(runs(own)) for _, own in self.pending.values())

    def state(self) -> CursorState:
        pending = tuple(PendingAck(txn, c, runs(own)) for txn, (c, own)
                        in sorted(self.pending.items()))
        return CursorState(self.cumulative_end, self.individual(), pending,
                           tuple(self.ended.items()))

    def normalize(self) -> None:
        cumulative_end = self.cumulative_end
        for item in self.pending.values():
            item[1] -= self.acked
            if item[0] <= cumulative_end:
                item[0] = 0

    def expect_ack(self, cumulative_end: int, ranges, txn, limit: int) -> str:
        """The outcome: ACCEPT, NOOP or a reason."""
        requested = offsets_of(ranges)
        if not cumulative_end and not ranges:
            return "INVALID_ARGUMENT"
        if max([cumulative_end] + [e for _, e in ranges]) > limit:
            return "OFFSET_OUT_OF_RANGE"
        current = self.cumulative_end
        if txn is None:
            claim = (requested | set(range(cumulative_end))) - self.acked
            if claim & self.claims():
                return "TRANSACTION_CONFLICT"
            if not claim:
                return "NOOP"
            after = self.acked | claim
            grown = len(self.individual(after)) - len(self.individual())
            if grown > 0 and self.range_count() + grown > LIMITS.max_ranges:
                return "RESOURCE_EXHAUSTED"
            return "ACCEPT"
        if txn in self.ended:
            return "TRANSACTION_NOT_OPEN"
        own = self.pending.get(txn)
        floor = self.log_start
        if own is not None and floor and (cumulative_end <= floor or cumulative_end <= own[0]) \
                and {o for o in requested if o >= floor} <= own[1]:
            return "NOOP"  # its own acks, and what retention took out of them
        if requested & self.acked or 0 < cumulative_end <= current:
            return "TRANSACTION_CONFLICT"
        claim = requested | (set(range(current, cumulative_end)) - self.acked)
        if claim & self.claims(except_txn=txn):
            return "TRANSACTION_CONFLICT"
        own = self.pending.get(txn)
        if own is not None and cumulative_end <= own[0] and requested <= own[1]:
            return "NOOP"
        if own is None and len(self.pending) >= LIMITS.max_pending_transactions:
            return "RESOURCE_EXHAUSTED"
        before = runs(own[1]) if own else ()
        grown = len(runs((own[1] if own else set()) | requested)) - len(before)
        if grown > 0 and self.range_count() + grown > LIMITS.max_ranges:
            return "RESOURCE_EXHAUSTED"
        return "ACCEPT"

    def apply_ack(self, cumulative_end: int, ranges, txn) -> set[int]:
        """Returns the offsets that stopped being deliverable."""
        requested = offsets_of(ranges)
        current = self.cumulative_end
        if txn is None:
            claim = (requested | set(range(cumulative_end))) - self.acked
            self.acked |= claim
            return claim
        window = set(range(current, cumulative_end)) - self.acked
        own = self.pending.setdefault(txn, [0, set()])
        if cumulative_end > current:
            own[0] = max(own[0], cumulative_end)
        own[1] |= requested
        return window | requested

    def end_txn(self, txn: TxnId, committed: bool) -> None:
        own = self.pending.pop(txn, None)
        if own is not None and committed:
            self.acked |= set(range(own[0])) | own[1]
        self.ended.pop(txn, None)
        self.ended[txn] = committed
        while len(self.ended) > LIMITS.max_remembered_transactions:
            self.ended.popitem(last=False)

    def forget_below(self, log_start: int) -> None:
        self.log_start = max(self.log_start, log_start)
        self.acked |= set(range(log_start))
        self.normalize()


class CursorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cursor = SubscriptionCursor(0, LIMITS)
        self.model = Model()
        self.outcomes: Counter[str] = Counter()  # what the rules did (for tuning)
        self.log_end = 12
        self.log_start = 0
        self.markers: set[int] = set()
        self.now_ms = 0
        self.out: dict[int, tuple[str | None, int]] = {}  # offset -> (consumer, deadline)
        self.snapshot = self.cursor.snapshot()
        self.journal: list[bytes] = []
        self.durable = 0
        self.history = [self.model.copy()]  # model after each journal entry

    # -- helpers ------------------------------------------------------------------------

    def write(self, entry) -> None:
        data = encode_entry(entry)
        assert decode_entry(data) == entry
        self.cursor.apply(entry)
        self.journal.append(data)
        self.history.append(self.model.copy())

    def live_out(self) -> dict[int, tuple[str | None, int]]:
        return {o: v for o, v in self.out.items() if v[1] > self.now_ms}

    def drop_out(self, offsets) -> None:
        for offset in offsets:
            self.out.pop(offset, None)

    def recover(self, entries: list[bytes]) -> SubscriptionCursor:
        cursor = SubscriptionCursor.restore(self.snapshot, LIMITS)
        for data in entries:
            cursor.apply(decode_entry(data))
        cursor.forget_below(self.log_start)
        return cursor

    # -- rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.log_end < LOG_MAX)
    @rule(data=st.data(), count=st.integers(1, 6))
    def produce(self, data, count):
        for offset in range(self.log_end, min(self.log_end + count, LOG_MAX)):
            if data.draw(st.integers(0, 4)) == 0:
                self.markers.add(offset)
        self.log_end = min(self.log_end + count, LOG_MAX)

    @rule(data=st.data(), transactional=st.booleans())
    def acknowledge(self, data, transactional):
        low, top = max(self.model.cumulative_end - 2, 0), self.log_end
        txn = data.draw(st.sampled_from(TXNS)) if transactional else None
        cumulative = data.draw(st.integers(0, 4)) == 0  # rarer: it claims a whole window
        cumulative_end = data.draw(st.integers(low, top + 1)) if cumulative else 0
        ranges = [(s, s + n) for s, n in data.draw(st.lists(
            st.tuples(st.integers(low, max(top - 1, low)), st.integers(1, 2)),
            min_size=0 if cumulative_end or data.draw(st.integers(0, 5)) == 0 else 1,
            max_size=3))]
        self.ack(cumulative_end, ranges, txn)

    @rule(data=st.data(), consumer=st.sampled_from(CONSUMERS), transactional=st.booleans())
    def acknowledge_delivered(self, data, consumer, transactional):
        """What consumers mostly do: ack some of what they received, one by one."""
        mine = sorted(o for o, (owner, _) in self.live_out().items() if owner == consumer)
        if not mine:
            return
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=3, unique=True))
        txn = data.draw(st.sampled_from(TXNS)) if transactional else None
        self.ack(0, [(o, o + 1) for o in chosen], txn)

    def ack(self, cumulative_end: int, ranges: list, txn: TxnId | None) -> None:
        expected = self.model.expect_ack(cumulative_end, ranges, txn, self.log_end)
        self.outcomes[f"{'txn' if txn else 'plain'} {expected}"] += 1
        try:
            entry = self.cursor.check_ack(cumulative_end, ranges, txn, limit=self.log_end)
        except AtomlogError as error:
            assert error.reason == expected, (error, expected)
            return
        assert ("NOOP" if entry is None else "ACCEPT") == expected
        if entry is not None:
            self.drop_out(self.model.apply_ack(cumulative_end, ranges, txn))
            self.write(entry)

    @rule(data=st.data(), committed=st.booleans())
    def marker(self, data, committed):
        txn = data.draw(st.sampled_from(sorted(self.model.pending) + TXNS[:2]))
        remembered = self.model.ended.get(txn)
        try:
            plan = self.cursor.plan_end_txn(txn, committed)
        except AtomlogError as error:
            assert remembered is not None and remembered != committed
            assert error.reason == ("TRANSACTION_ALREADY_COMMITTED" if remembered
                                    else "TRANSACTION_ABORTED")
            return
        if txn in self.model.pending or remembered is None:
            assert plan.entry == TxnEnded(txn, committed) and not plan.already_ended
            self.model.end_txn(txn, committed)
            self.drop_out(o for o in list(self.out) if o in self.model.acked)
            self.write(plan.entry)
        else:
            assert plan.entry is None and plan.already_ended and remembered == committed

    @rule(consumer=st.sampled_from(CONSUMERS), max_offsets=st.integers(1, 8),
          read_new=st.booleans())
    def receive(self, consumer, max_offsets, read_new):
        cursor, model = self.cursor, self.model
        plan = cursor.read_plan(self.now_ms, max_offsets)
        old_position = cursor.read_position
        scanned = list(plan.redeliver)
        if read_new and plan.new_allowed and plan.new_from < self.log_end:
            scanned.append((plan.new_from, self.log_end))
        readable = [(o, o + 1) for s, e in scanned for o in range(s, e) if o not in self.markers]
        delivery = cursor.next_delivery(consumer, readable, scanned, self.now_ms, TIMEOUT_MS,
                                        max_offsets)
        delivered = offsets_of(delivery.delivered)
        redelivered = offsets_of(delivery.redelivered)
        self.outcomes["delivered"] += len(delivered)
        self.outcomes["redelivered"] += len(redelivered)
        self.outcomes["skipped"] += len(offsets_of(delivery.skip.ranges)) if delivery.skip else 0
        claims, live = model.claims(), self.live_out()
        assert len(delivered) <= max_offsets
        assert delivered <= offsets_of(readable) - model.acked - claims - set(live)
        assert redelivered <= delivered and all(o < old_position for o in redelivered)
        assert all(o >= old_position for o in delivered - redelivered)
        position = delivery.read_position
        assert old_position <= position <= max(self.log_end, model.cumulative_end)
        # Holes go lowest first and before anything new; nothing deliverable is passed
        # over by the read position.
        free = offsets_of(readable) - model.acked - claims - set(live)
        left_behind = {o for o in free if o < old_position} - delivered
        if left_behind:
            assert delivered == redelivered and len(redelivered) == max_offsets
            assert max(redelivered) < min(left_behind)
        assert not {o for o in free if old_position <= o < position} - delivered
        if delivery.skip is not None:
            skipped = offsets_of(delivery.skip.ranges)
            assert skipped <= (self.markers & offsets_of(scanned)) - model.acked - claims
            model.acked |= skipped
            self.write(delivery.skip)
        for offset in delivered:
            self.out[offset] = (consumer, self.now_ms + TIMEOUT_MS)
        assert cursor.range_count <= LIMITS.max_ranges

    @rule(ms=st.sampled_from([1, 30, 99, 100, 250]))
    def advance_time(self, ms):
        self.now_ms += ms

    @rule(consumer=st.sampled_from(CONSUMERS), data=st.data(),
          delay_ms=st.sampled_from([0, 0, 50]))
    def nack(self, consumer, data, delay_ms):
        live = self.live_out()
        mine = sorted(o for o, (owner, _) in live.items() if owner == consumer)
        if data.draw(st.booleans()):
            ranges, chosen = None, set(mine)
        else:
            ranges = [(s, s + n) for s, n in data.draw(st.lists(
                st.tuples(st.integers(0, LOG_MAX), st.integers(1, 3)), max_size=2))]
            chosen = set(mine) & offsets_of(ranges)
        assert self.cursor.nack(consumer, ranges, self.now_ms, delay_ms) == len(chosen)
        for offset in chosen:
            if delay_ms:
                self.out[offset] = (None, self.now_ms + delay_ms)
            else:
                del self.out[offset]

    @rule(consumer=st.sampled_from(CONSUMERS))
    def release(self, consumer):
        mine = [o for o, (owner, _) in self.live_out().items() if owner == consumer]
        assert self.cursor.release_consumer(consumer) == len(mine)
        self.drop_out(mine)

    @rule(data=st.data())
    def retention(self, data):
        new_start = data.draw(st.integers(self.log_start, self.log_end))
        self.log_start = new_start
        self.cursor.forget_below(new_start)
        self.model.forget_below(new_start)
        self.drop_out(o for o in list(self.out) if o < self.model.cumulative_end)

    @rule(data=st.data())
    def reset(self, data):
        position = data.draw(st.integers(self.log_start, self.log_end))
        try:
            entry = self.cursor.plan_reset(position)
        except AtomlogError as error:
            assert error.reason == "TRANSACTION_CONFLICT" and self.model.pending
            return
        assert not self.model.pending
        self.model.acked = set(range(position))
        self.out.clear()
        self.write(entry)

    @rule(data=st.data())
    def data_loss(self, data):
        """An operator accepts losing the log from `end` on (RecoverPartition): the owner
        cuts the cursor back before serving; what is written there next is new."""
        self.durable = len(self.journal)  # the reload's close synced what was staged
        end = data.draw(st.integers(self.log_start, self.log_end))
        model = self.model
        above = {o for o in model.acked if o >= end} or any(
            c > end or any(o >= end for o in own) for c, own in model.pending.values()) \
            or self.cursor.read_position > end
        entry = self.cursor.plan_truncate(end)
        self.outcomes[f"truncate {'cut' if entry else 'none'}"] += 1
        assert (entry is not None) == bool(above), (entry, end)
        self.log_end = end
        self.markers = {o for o in self.markers if o < end}
        self.drop_out(o for o in list(self.out) if o >= end)
        if entry is None:
            return
        model.acked = {o for o in model.acked if o < end}
        for item in model.pending.values():
            item[0] = min(item[0], end)
            item[1] = {o for o in item[1] if o < end}
        model.normalize()
        self.write(entry)
        self.durable = len(self.journal)  # the cut is fsynced before the partition serves
        assert self.cursor.read_position <= end

    @rule()
    def take_snapshot(self):
        self.snapshot = self.cursor.snapshot()
        self.journal, self.durable = [], 0
        self.history = [self.model.copy()]

    @rule()
    def sync(self):
        self.durable = len(self.journal)

    @rule()
    def crash_and_recover(self):
        """kill -9: the journal after the last sync is lost, and every delivery."""
        self.journal = self.journal[:self.durable]
        self.history = self.history[:self.durable + 1]
        self.cursor = self.recover(self.journal)
        self.model = self.history[-1].copy()
        self.model.forget_below(self.log_start)
        self.out.clear()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def cursor_equals_the_model(self):
        assert self.cursor.state() == self.model.state()
        assert self.cursor.range_count == self.model.range_count() <= LIMITS.max_ranges
        assert self.cursor.pending_count <= LIMITS.max_pending_transactions

    @invariant()
    def deliveries_equal_the_model(self):
        cursor, model = self.cursor, self.model
        description = cursor.describe(self.log_end, self.now_ms)
        live = self.live_out()
        live = {o: v for o, v in live.items() if o not in model.acked and o not in
                model.claims()}
        claims = model.claims()
        position = cursor.read_position
        holes = {o for o in range(model.cumulative_end, position)
                 if o not in model.acked and o not in claims and o not in live}
        assert description.delivered_unacknowledged_count == sum(
            1 for owner, _ in live.values() if owner is not None)
        assert description.redelivery_backlog_count == len(holes) + sum(
            1 for owner, _ in live.values() if owner is None)
        assert description.backlog_records == len(
            set(range(model.cumulative_end, self.log_end)) - model.acked - claims)
        # What a long poll waits for (describe expired what was due).
        assert cursor.next_deadline_ms() == min(
            (deadline for _, deadline in live.values()), default=None)

    @invariant()
    def snapshot_plus_journal_equals_live(self):
        assert self.recover(self.journal).state() == self.cursor.state()


TestCursorMachine = CursorMachine.TestCase
TestCursorMachine.settings = settings(max_examples=150, stateful_step_count=80, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
