"""The native TxnGuard (partition_server/rust/src/txn_guard.rs) against the Python
reference (partition_server/txn_guard.py), side by side: random sequences of tokens,
verifications remembered, markers, cache lookups and write checks, with small and default
bounds; every answer, exception and property must be the same. The rules themselves are
tests/test_txn_guard.py's (which looks at the reference's private fields)."""

from __future__ import annotations

import os
import random

import pytest

from partition_server import native
from partition_server.record_batch import TxnId
from partition_server.txn_guard import DEFAULT_MAX_CACHED, DEFAULT_MAX_ENDED, TxnGuard, Verified

NativeGuard = getattr(native.core, "TxnGuard", None)
pytestmark = pytest.mark.skipif(NativeGuard is None,
                                reason=f"no native TxnGuard: {native.status()}")

SEEDS = int(os.environ.get("ATOMLOG_GUARD_DIFF_SEEDS", "200"))


def outcome(call, *args):
    try:
        return ("ok", call(*args))
    except Exception as error:  # noqa: BLE001 - every exception is compared
        return ("raise", type(error), repr(error.args))


def properties(guard) -> tuple:
    return (guard.generation, guard.horizon, guard.cached_count, guard.token(),
            guard.max_cached, guard.max_ended)


def test_the_constructor_s_defaults_and_assertion():
    assert properties(NativeGuard()) == properties(TxnGuard())
    assert NativeGuard().max_cached == DEFAULT_MAX_CACHED
    assert NativeGuard().max_ended == DEFAULT_MAX_ENDED
    for args in ((0, 1), (1, 0), (-5, 3)):
        assert outcome(NativeGuard, *args) == outcome(TxnGuard, *args)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_sequences_answer_the_same(seed):
    rng = random.Random(seed)
    max_cached, max_ended = rng.choice([(1, 1), (2, 3), (4, 2), (10, 10), (100, 100)])
    mine, theirs = TxnGuard(max_cached, max_ended), NativeGuard(max_cached, max_ended)
    txns = [TxnId(rng.randrange(3), rng.randrange(1, 8)) for _ in range(8)]
    tokens: list[int] = [0]
    for _ in range(300):
        txn = rng.choice(txns)
        action = rng.random()
        if action < 0.2:
            tokens.append(mine.token())
            assert theirs.token() == tokens[-1]
        elif action < 0.45:
            token = rng.choice(tokens)
            session = rng.choice([None, (7, 0), (rng.randrange(1, 100), rng.randrange(3))])
            opener = rng.choice([None, "", "alice"])
            args = (txn, token, session) if opener is None else (txn, token, session, opener)
            assert outcome(mine.remember, *args) == outcome(theirs.remember, *args)
        elif action < 0.65:
            a, b = outcome(mine.cached, txn), outcome(theirs.cached, txn)
            assert a == b
            if a[1] is not None:
                assert type(b[1]) is Verified
        elif action < 0.85:
            token = rng.choice(tokens + [-1, 10**30, mine.generation + 5])
            assert outcome(mine.allows, txn, token) == outcome(theirs.allows, txn, token)
        else:
            assert outcome(mine.on_marker, txn) == outcome(theirs.on_marker, txn)
        assert properties(mine) == properties(theirs)
    for txn in txns:  # a token that is not an int: refused as the reference refuses it
        assert outcome(mine.allows, txn, None) == outcome(theirs.allows, txn, None)


def test_many_markers_keep_eviction_and_horizon_the_same():
    mine, theirs = TxnGuard(5, 3), NativeGuard(5, 3)
    rng = random.Random(7)
    for step in range(5_000):
        txn = TxnId(rng.randrange(2), rng.randrange(1, 6))
        mine.on_marker(txn)
        theirs.on_marker(txn)
        if step % 7 == 0:
            token = max(0, mine.generation - rng.randrange(10))
            assert mine.remember(txn, token, None) == theirs.remember(txn, token, None)
        assert properties(mine) == properties(theirs)
