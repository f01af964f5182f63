"""The presumed-abort checker's pure decisions (partition_server/txn_checker.py): which
open transactions a round looks up, and what each answer means. The checker itself runs
against real coordinators and partitions in tests/test_one_call.py and the chaos harness.

A ZooKeeper blip while looking a transaction up is counted as that lookup's answer and
leaves the transaction for the next round, without failing the round for the others or
logging a traceback; any other unexpected failure still fails the round (a bug, logged)."""

from __future__ import annotations

import pytest
from kazoo.exceptions import ConnectionLoss, SessionExpiredError

from atomlog.v1 import coordinator_pb2
from partition_server.txn_checker import TxnChecker, due_lookups, lookup_outcome
from services.errors import AtomlogError


def test_a_transaction_is_looked_up_once_open_long_enough_and_forgotten_once_ended():
    a, b, c = ("t", 0, None, (1, 1)), ("t", 0, None, (1, 2)), ("t", 1, "sub", (2, 1))
    seen, asked, due = due_lookups({}, {}, {a: None, b: None}, now=100.0, check_after_s=10,
                                   max_per_round=100)
    assert seen == {a: 100.0, b: 100.0} and due == [] and asked == {}
    seen, asked, due = due_lookups(seen, asked, {a: None, c: None}, now=105.0,
                                   check_after_s=10, max_per_round=100)
    assert seen == {a: 100.0, c: 105.0} and due == []  # b ended: forgotten
    seen, asked, due = due_lookups(seen, asked, {a: None, c: None}, now=110.0,
                                   check_after_s=10, max_per_round=100)
    assert due == [a] and asked == {a: 110.0}
    seen, asked, due = due_lookups(seen, asked, {a: None, c: None}, now=115.0,
                                   check_after_s=10, max_per_round=1)
    assert due == [c]  # at most max_per_round: the one never asked first
    seen, asked, due = due_lookups(seen, asked, {c: None}, now=116.0, check_after_s=10,
                                   max_per_round=1)
    assert due == [c] and asked == {c: 116.0}  # a ended: forgotten


def test_every_due_transaction_is_looked_up_however_many_stay_open():
    """More due transactions than a round asks about, and the first ones stay open (long
    transactions their coordinators answer OPEN about): before, the same first
    max_per_round were asked every round, and a hanging one behind them (a one-call
    transaction whose coordinator never decided it) never was, holding the partition's
    max read position for as long as the others stayed open."""
    open_long = [("t", 0, None, (1, n)) for n in range(1, 1001)]
    hanging = ("t", 1, None, (2, 1))
    found = dict.fromkeys([*open_long, hanging])
    seen, asked, now, rounds = {}, {}, 0.0, 0
    while True:
        seen, asked, due = due_lookups(seen, asked, found, now, check_after_s=10,
                                       max_per_round=300)
        if hanging in due:
            break
        now, rounds = now + 1.0, rounds + 1
        assert rounds < 20
    assert rounds <= 10 + 1000 // 300  # its check_after_s, then a turn of the others


def test_a_transaction_whose_coordinator_changed_is_looked_up_at_once():
    """Its coordinator's successor is the only one left to decide it: asked at the next
    round, not after check_after_s (a one-call transaction whose coordinator died between
    staging and deciding held its partitions for 10 s)."""
    a, b = ("t", 0, None, (1, 1)), ("t", 0, None, (2, 1))
    seen, asked, due = due_lookups({}, {}, {a: None, b: None}, now=100.0, check_after_s=10,
                                   max_per_round=100)
    assert due == []
    seen, asked, due = due_lookups(seen, asked, {a: None, b: None}, now=101.0,
                                   check_after_s=10, max_per_round=100, moved={a})
    assert due == [a] and asked == {a: 101.0}


class _Epochs:
    def __init__(self):
        self.epochs: dict[int, int] = {}

    def current(self, tc_partition: int) -> int:
        return self.epochs.get(tc_partition, 0)


def test_the_checker_finds_the_transactions_whose_coordinator_changed_and_forgets_them():
    """TxnChecker._moved_keys: a rise of a TC partition's epoch after a transaction was
    first seen marks it; one first seen after the rise is not; one that ended is
    forgotten."""
    verifier = type("Verifier", (), {})()
    verifier.epochs = _Epochs()
    checker = TxnChecker(manager=None, verifier=verifier, check_after_ms=10_000,
                         interval_ms=1_000)
    a, b = ("t", 0, None, (1, 1)), ("t", 1, "s", (2, 1))
    assert checker._moved_keys({a: None, b: None}) == set()
    verifier.epochs.epochs[1] = 3
    c = ("t", 0, None, (1, 2))  # first seen after the rise
    assert checker._moved_keys({a: None, b: None, c: None}) == {a}
    assert checker._moved_keys({b: None, c: None}) == set()
    assert set(checker._seen_epoch) == {b, c}


@pytest.mark.parametrize("blip", [SessionExpiredError(), ConnectionLoss()])
def test_a_zookeeper_blip_is_a_lookups_answer_that_aborts_nothing(blip):
    assert lookup_outcome(blip) == ("ZOOKEEPER_UNAVAILABLE", None)


def test_an_unexpected_failure_still_fails_the_round():
    bug = RuntimeError("a bug")
    with pytest.raises(RuntimeError) as raised:
        lookup_outcome(bug)
    assert raised.value is bug


def test_a_refusal_is_counted_by_its_reason_and_aborts_nothing():
    assert lookup_outcome(AtomlogError("NOT_COORDINATOR", "moved")) == ("NOT_COORDINATOR", None)


def test_only_an_aborted_answer_aborts_with_the_answering_coordinators_epoch():
    assert lookup_outcome((coordinator_pb2.TXN_STATE_ABORTED, 7)) == ("ABORTED", 7)
    for state, label in ((coordinator_pb2.TXN_STATE_OPEN, "OPEN"),
                         (coordinator_pb2.TXN_STATE_COMMITTING, "COMMITTING"),
                         (coordinator_pb2.TXN_STATE_ABORTING, "ABORTING")):
        assert lookup_outcome((state, 7)) == (label, None)
