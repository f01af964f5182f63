"""The presumed-abort checker's round (partition_server/txn_checker.py), its pure
decisions with fakes for the partitions and the coordinators' answers (the real thing
runs in tests/test_one_call.py and the chaos harness): a ZooKeeper blip while looking a
transaction up is counted as that lookup's answer and leaves the transaction for the next
round, without failing the round for the others or logging a traceback; any other
unexpected failure still fails the round (a bug, logged)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from kazoo.exceptions import SessionExpiredError

from atomlog.v1 import coordinator_pb2
from partition_server.owner import State
from partition_server.txn_checker import CHECKS, TxnChecker
from services.errors import AtomlogError


class Owner:
    def __init__(self, partition: int, txns: list[tuple[int, int]]):
        self.topic, self.partition, self.name = "t", partition, f"t-{partition}"
        self.state, self.txns_recovering = State.ONLINE, False
        self.open = list(txns)
        self.txns = SimpleNamespace(describe=lambda: [SimpleNamespace(txn=t) for t in self.open])
        self.subscriptions = SimpleNamespace(names=lambda: [])
        self.ended: list = []

    async def end_transactions(self, markers):
        self.ended += markers
        self.open = [t for t in self.open if t not in {m.txn for m in markers}]
        return [None for _ in markers]


class Verifier:
    """Answers per transaction: an exception to raise, or a TxnState."""

    def __init__(self, answers: dict):
        self.answers = answers

    async def state(self, txn, topic, partition, *, subscription=None):
        answer = self.answers[tuple(txn)]
        if isinstance(answer, BaseException):
            raise answer
        return answer, 7


def checker(owners, answers) -> TxnChecker:
    manager = SimpleNamespace(owners={o.partition: o for o in owners})
    return TxnChecker(manager, Verifier(answers), check_after_ms=0, interval_ms=1000)


def counted(answer: str) -> float:
    return CHECKS.labels(answer).get()


def test_a_zookeeper_blip_is_a_lookups_answer_and_the_others_go_on(caplog):
    blip, unknown, live = (1, 1), (1, 2), (1, 3)
    owners = [Owner(0, [blip, unknown]), Owner(1, [live])]
    answers = {blip: SessionExpiredError(), unknown: coordinator_pb2.TXN_STATE_ABORTED,
               live: coordinator_pb2.TXN_STATE_OPEN}
    round_ = checker(owners, answers)
    before = counted("ZOOKEEPER_UNAVAILABLE")
    with caplog.at_level(logging.WARNING, logger="atomlog.partition.txn_checker"):
        aborted = asyncio.run(round_.check_once())
    assert aborted == 1  # the unknown one, presumed aborted despite the blip beside it
    assert [m.txn for m in owners[0].ended] == [unknown]
    assert owners[1].ended == []
    assert counted("ZOOKEEPER_UNAVAILABLE") == before + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # the blipped transaction stays due: the next round asks again
    answers[blip] = coordinator_pb2.TXN_STATE_ABORTED
    assert asyncio.run(round_.check_once()) == 1
    assert [m.txn for m in owners[0].ended] == [unknown, blip]


def test_an_unexpected_failure_still_fails_the_round():
    owners = [Owner(0, [(2, 1)])]
    round_ = checker(owners, {(2, 1): RuntimeError("a bug")})
    with pytest.raises(RuntimeError):
        asyncio.run(round_.check_once())


def test_a_refusal_is_counted_by_its_reason_and_aborts_nothing():
    owners = [Owner(0, [(3, 1)])]
    round_ = checker(owners, {(3, 1): AtomlogError("NOT_COORDINATOR", "moved")})
    before = counted("NOT_COORDINATOR")
    assert asyncio.run(round_.check_once()) == 0
    assert owners[0].ended == [] and counted("NOT_COORDINATOR") == before + 1
