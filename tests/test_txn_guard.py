"""The late-write guard (partition_server/txn_guard.py), a pure core: a write verified
before a marker for its transaction never passes after it, whatever the interleaving
and however small the bounds."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from partition_server.record_batch import TxnId
from partition_server.txn_guard import TxnGuard

TXNS = st.builds(TxnId, st.integers(0, 2), st.integers(1, 6))


def test_a_marker_during_verification_refuses_the_write():
    guard = TxnGuard()
    txn = TxnId(0, 1)
    token = guard.token()          # verification starts
    guard.on_marker(txn)           # the coordinator aborted; its marker lands first
    assert not guard.remember(txn, token, None)
    assert guard.cached(txn) is None
    assert not guard.allows(txn, token)


def test_cached_answers_are_reused_until_a_marker():
    guard = TxnGuard()
    txn, other = TxnId(1, 5), TxnId(1, 6)
    assert guard.remember(txn, guard.token(), (7, 0))
    assert guard.cached(txn).session == (7, 0)
    guard.on_marker(other)
    assert guard.cached(txn) is not None  # another transaction's marker changes nothing
    guard.on_marker(txn)
    assert guard.cached(txn) is None


def test_evicting_ended_entries_raises_the_horizon():
    guard = TxnGuard(max_cached=10, max_ended=2)
    old = guard.token()
    for sequence in range(1, 4):
        guard.on_marker(TxnId(0, sequence))
    # TxnId(0, 1) was forgotten: any verification older than its marker is refused.
    assert guard.horizon == 1
    assert not guard.allows(TxnId(0, 1), old)
    assert not guard.allows(TxnId(2, 9), old)
    assert guard.allows(TxnId(2, 9), guard.token())


class GuardModel(RuleBasedStateMachine):
    """Model: the set of transactions a marker was applied for. A write verified at token
    t for txn may be appended only while no marker for txn was applied (the coordinator
    decides before it sends markers, so after one it never answers OPEN again)."""

    @initialize(max_ended=st.integers(1, 4), max_cached=st.integers(1, 4))
    def start(self, max_ended, max_cached):
        self.guard = TxnGuard(max_cached=max_cached, max_ended=max_ended)
        self.marked: set[TxnId] = set()
        self.tokens: list[tuple[TxnId, int]] = []  # verifications in flight
        self.answered: list[tuple[TxnId, int]] = []

    @rule(txn=TXNS)
    def verify_starts(self, txn):
        self.tokens.append((txn, self.guard.token()))

    @rule(txn=TXNS)
    def marker(self, txn):
        self.guard.on_marker(txn)
        self.marked.add(txn)

    @rule(index=st.integers(0, 50))
    def verify_answers(self, index):
        """The coordinator answers OPEN only while no marker was sent (it decides first)."""
        if self.tokens:
            txn, token = self.tokens.pop(index % len(self.tokens))
            if txn not in self.marked:
                self.guard.remember(txn, token, None)
                self.answered.append((txn, token))

    @invariant()
    def never_after_a_marker(self):
        for txn, token in self.answered:  # writes queued with a positive answer
            if txn in self.marked:
                assert not self.guard.allows(txn, token)
        for txn in self.marked:
            assert self.guard.cached(txn) is None

    @invariant()
    def bounded(self):
        assert self.guard.cached_count <= self.guard.max_cached
        assert len(self.guard._ended) <= self.guard.max_ended


GuardModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                        deadline=None)
TestGuardModel = GuardModel.TestCase
