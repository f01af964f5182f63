"""The late-write guard (partition_server/txn_guard.py), a pure core: a write verified
before a marker for its transaction never passes after it, whatever the interleaving
and however small the bounds."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from partition_server.record_batch import TxnId, txn_key
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


def test_repeated_markers_keep_the_ended_order_bounded_and_evict_the_right_entry():
    guard = TxnGuard(max_cached=10, max_ended=3)
    a, b, c, d = (TxnId(1, n) for n in (1, 2, 3, 4))
    guard.on_marker(a)
    guard.on_marker(b)
    for _ in range(500):  # markers re-sent (a coordinator's retries, a failover)
        guard.on_marker(a)
        guard.on_marker(c)
    assert len(guard._ended_order[0]) - guard._ended_head <= 2 * 3 + 65
    token = guard.token()
    guard.on_marker(d)  # four ended: the oldest by last marker is b
    assert set(guard._ended) == {txn_key(t) for t in (a, c, d)}
    assert guard.horizon == 2  # b's marker was generation 1
    assert guard.allows(TxnId(2, 9), token) and not guard.allows(TxnId(2, 9), 1)


class GuardModel(RuleBasedStateMachine):
    """Model: the set of transactions a marker was applied for. A write verified at token
    t for txn may be appended only while no marker for txn was applied (the coordinator
    decides before it sends markers, so after one it never answers OPEN again)."""

    @initialize(max_ended=st.integers(1, 4), max_cached=st.integers(1, 4))
    def start(self, max_ended, max_cached):
        self.guard = TxnGuard(max_cached=max_cached, max_ended=max_ended)
        # The ended set as the guard kept it before (an OrderedDict moved to the end on each
        # marker, the oldest evicted): its lazily ordered dict must evict alike.
        self.reference: OrderedDict[TxnId, int] = OrderedDict()
        self.horizon = 0
        self.marked: set[TxnId] = set()
        self.tokens: list[tuple[TxnId, int]] = []  # verifications in flight
        self.answered: list[tuple[TxnId, int]] = []

    @rule(txn=TXNS)
    def verify_starts(self, txn):
        self.tokens.append((txn, self.guard.token()))

    @rule(txn=TXNS)
    def marker(self, txn):
        self.reference[txn] = self.guard.generation
        self.reference.move_to_end(txn)
        while len(self.reference) > self.guard.max_ended:
            _, generation = self.reference.popitem(last=False)
            self.horizon = max(self.horizon, generation + 1)
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
        order = self.guard._ended_order[0]
        assert len(order) - self.guard._ended_head <= 2 * len(self.guard._ended) + 65

    @invariant()
    def ends_and_evicts_as_an_ordered_dict_would(self):
        assert self.guard._ended == {txn_key(txn): generation
                                     for txn, generation in self.reference.items()}
        assert self.guard.horizon == self.horizon


GuardModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                        deadline=None)
TestGuardModel = GuardModel.TestCase
