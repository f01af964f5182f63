"""The native write step (partition_server/rust/src/write_step.rs, `decide_write_step`)
against the Python reference (partition_server/write_step.py `decide`), side by side.

Random sequences of groups (seeded: each seed is one sequence) are decided by the Python
core on the Python tables (ProducerStateTable, TxnBuffer, TxnGuard) and by the native core
on the native tables. The groups mix stage works of one-call transactions with their
coordinator epochs (current, stale, repeated), produce works of idempotent and
transactional batches with and without verification tokens (current, stale, failed
verifications), duplicates, out-of-order and fenced batches, marker works (COMMIT, ABORT,
stale epochs, no-op and conflicting markers), resolutions, and too-few refusals. Every
result must be the same (type and fields; errors by reason, message and metadata; the
too-few refusal by identity), and so must the accepted batches (bytes and headers), the
expected bases, the counts, and after each group the tables' state (snapshot bytes,
metrics, properties).
"""

from __future__ import annotations

import os
import random

import pytest

from partition_server import native, write_step
from partition_server.producer_state import ProducerStateTable
from partition_server.record_batch import (ControlType, Record, TxnId, encode_batch,
                                           parse_header, stamp_transaction)
from partition_server.txn_buffer import TxnBuffer, TxnBufferLimits
from partition_server.txn_guard import TxnGuard
from partition_server.write_step import (Appended, Marker, MarkerResult, _MarkerWork,
                                         _ResolveWork, _Work)
from services.errors import AtomlogError

core = native.core
decide_native = getattr(core, "decide_write_step", None)
pytestmark = pytest.mark.skipif(decide_native is None,
                                reason=f"no native write step: {native.status()}")

SEEDS = int(os.environ.get("ATOMLOG_WRITE_STEP_DIFF_SEEDS", "150"))
GROUPS = 40
NOW = 1_700_000_000_000
NAME = "topic-3"
COMMIT, ABORT = ControlType.COMMIT, ControlType.ABORT


def tables(native_side: bool, max_open: int):
    limits = TxnBufferLimits(max_open_transactions=max_open, max_aborted_transactions=50,
                             max_remembered_commits=50)
    if native_side:
        return (core.ProducerStateTable(4, 3_600_000), core.TxnBuffer(limits),
                core.TxnGuard(20, 6))
    return ProducerStateTable(4, 3_600_000), TxnBuffer(limits), TxnGuard(20, 6)


def result_key(result):
    if isinstance(result, AtomlogError):
        return ("error", type(result), result.reason, result.message, result.metadata,
                result.args)
    if isinstance(result, (Appended, MarkerResult)):
        return (type(result), repr(result), result)
    return (type(result), result)


def batch_key(item):
    data, header = item
    return (bytes(data), type(header), tuple(header))


def state(producers, txns, guard, offset: int):
    return (producers.snapshot(offset), producers.metrics, producers.producer_count,
            producers.last_applied_offset, txns.snapshot(offset), txns.metrics, txns.changes,
            txns.state(), dict(txns.coordinator_epochs()), guard.generation, guard.horizon,
            guard.cached_count)


class Scenario:
    """The random inputs: producers with their epochs and sequences, transactions, the
    server's coordinator epochs."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.sequences = {pid: 0 for pid in (11, 12, 13)}
        self.epochs = {pid: 0 for pid in (11, 12, 13)}
        self.sent: list = []  # batches sent before (for duplicates)
        self.txns = [TxnId(tc, seq) for tc in (1, 2) for seq in range(1, 7)]
        self.server_epochs = {1: 0, 2: 0}

    def records(self) -> list[Record]:
        return [Record(b"k%d" % i, b"v" * self.rng.randrange(1, 40))
                for i in range(self.rng.randrange(1, 4))]

    def data_batch(self, txn: TxnId | None):
        rng = self.rng
        if self.sent and rng.random() < 0.15:
            return rng.choice(self.sent)  # a retry: duplicate (or out of the window)
        pid = rng.choice(list(self.sequences))
        if rng.random() < 0.08:
            self.epochs[pid] += 1
            self.sequences[pid] = 0
        epoch = self.epochs[pid]
        if rng.random() < 0.05:
            epoch = max(0, epoch - 1)  # fenced
        sequence = self.sequences[pid]
        if rng.random() < 0.07:
            sequence += rng.randrange(1, 5)  # out of order
        if rng.random() < 0.05:
            pid = 0  # not idempotent
        records = self.records()
        data = encode_batch(records, producer_id=pid, producer_epoch=epoch if pid else 0,
                            base_sequence=sequence if pid else -1, txn=txn, timestamp_ms=1_000)
        if pid:
            self.sequences[pid] = max(self.sequences[pid], sequence + len(records))
        item = (data, parse_header(data))
        self.sent.append(item)
        return item

    def staged_batch(self, txn: TxnId):
        data = encode_batch(self.records(), timestamp_ms=1_000)
        return stamp_transaction(data, parse_header(data), txn)


def make_group(scenario: Scenario, guard_tokens: list[int]) -> list:
    """Works for both sides: each side gets its own work objects (fresh results), with the
    same batches."""
    rng = scenario.rng
    specs = []
    for _ in range(rng.randrange(1, 7)):
        kind = rng.random()
        txn = rng.choice(scenario.txns)
        if kind < 0.25:
            epoch = scenario.server_epochs[txn.tc_partition] + rng.choice([0, 0, 0, -1, 1])
            specs.append(("stage", scenario.staged_batch(txn), txn, max(0, epoch)))
        elif kind < 0.6:
            batches, tokens = [], []
            for _ in range(rng.randrange(1, 4)):
                transactional = rng.random() < 0.5
                batches.append(scenario.data_batch(txn if transactional else None))
                choice = rng.random()
                if choice < 0.5 and guard_tokens:
                    tokens.append(rng.choice(guard_tokens))
                elif choice < 0.6:
                    tokens.append(AtomlogError("TRANSACTION_NOT_OPEN", "verification failed",
                                               {"txn": str(txn)}))
                else:
                    tokens.append(None)
            specs.append(("produce", batches, tokens if rng.random() < 0.8 else None))
        elif kind < 0.9:
            markers = []
            for _ in range(rng.randrange(1, 4)):
                marker_txn = rng.choice(scenario.txns)
                epoch = scenario.server_epochs[marker_txn.tc_partition] + rng.choice(
                    [0, 0, 1, -1])
                markers.append(Marker(marker_txn, rng.choice([COMMIT, ABORT]), max(0, epoch)))
            specs.append(("markers", markers))
        else:
            specs.append(("resolve", txn))
    return specs


def works(specs) -> list:
    out = []
    for spec in specs:
        if spec[0] == "stage":
            _, item, txn, epoch = spec
            out.append(_Work([item], None, None, size=item[1].size, staged=txn,
                             stage_epoch=epoch))
        elif spec[0] == "produce":
            _, batches, tokens = spec
            out.append(_Work(list(batches), None if tokens is None else list(tokens), None))
        elif spec[0] == "markers":
            out.append(_MarkerWork(list(spec[1]), None))
        else:
            out.append(_ResolveWork(spec[1], None))
    return out


def run(seed: int) -> None:
    rng = random.Random(seed)
    scenario = Scenario(rng)
    max_open = rng.choice([2, 4, 100])
    python_side, native_side = tables(False, max_open), tables(True, max_open)
    lookups = {"python": 0, "native": 0}

    def epoch_lookup(side):
        def lookup(tc: int) -> int:
            lookups[side] += 1
            return scenario.server_epochs[tc]
        return lookup

    with_lookup = rng.random() < 0.8
    next_offset, now = 0, NOW
    for step in range(GROUPS):
        now += rng.randrange(0, 5)
        # Verifications: tokens taken and remembered the way the servicer does.
        tokens = [python_side[2].token()]
        assert native_side[2].token() == tokens[0]
        for _ in range(rng.randrange(0, 3)):
            txn = rng.choice(scenario.txns)
            token = rng.choice([tokens[0], max(0, tokens[0] - rng.randrange(1, 4))])
            assert (python_side[2].remember(txn, token, None)
                    == native_side[2].remember(txn, token, None))
            tokens.append(token)
        if rng.random() < 0.1:
            tc = rng.choice([1, 2])
            scenario.server_epochs[tc] += 1
        too_few = (AtomlogError("NOT_ENOUGH_REPLICAS", "too few", {"isr": "1"})
                   if rng.random() < 0.1 else None)
        specs = make_group(scenario, tokens)
        mine, theirs = works(specs), works(specs)
        decided_py = write_step.decide(mine, now, next_offset, too_few, *python_side, NAME,
                                       epoch_lookup("python") if with_lookup else None)
        decided_native = decide_native(theirs, now, next_offset, too_few, *native_side, NAME,
                                       epoch_lookup("native") if with_lookup else None)
        where = f"seed {seed} group {step}: {specs}"
        assert type(decided_native) is write_step.Decided, where
        for a, b in zip(mine, theirs):
            assert len(a.results) == len(b.results), where
            for x, y in zip(a.results, b.results):
                assert result_key(x) == result_key(y), where
                assert (x is too_few) == (y is too_few), where
        assert ([batch_key(i) for i in decided_py.accepted]
                == [batch_key(i) for i in decided_native.accepted]), where
        assert decided_py[1:] == decided_native[1:], where
        next_offset = decided_py.next_offset
        assert state(*python_side, next_offset) == state(*native_side, next_offset), where


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_groups_are_decided_the_same(seed):
    run(seed)


def test_a_marker_writes_the_reference_s_control_batch():
    python_side, native_side = tables(False, 10), tables(True, 10)
    txn = TxnId(1, 1)
    decisions = []
    for side, decide in ((python_side, write_step.decide), (native_side, decide_native)):
        data = encode_batch([Record(b"k", b"v")], producer_id=5, producer_epoch=0,
                            base_sequence=0, txn=txn, timestamp_ms=1)
        side[2].remember(txn, side[2].token(), None)
        group = [_Work([(data, parse_header(data))], [side[2].token()], None),
                 _MarkerWork([Marker(txn, COMMIT, 0)], None), _ResolveWork(txn, None)]
        decided = decide(group, NOW, 0, None, *side, NAME, None)
        assert [type(r) for w in group for r in w.results] == [Appended, MarkerResult, bool]
        assert group[1].results == [MarkerResult(1, False)] and group[2].results == [True]
        assert decided.commits_written == 1 and decided.last_control_offset == 1
        decisions.append(decided)
    assert ([batch_key(i) for i in decisions[0].accepted]
            == [batch_key(i) for i in decisions[1].accepted])


def test_a_failing_epoch_lookup_refuses_the_stage_on_both():
    scenario = Scenario(random.Random(3))
    specs = [("stage", scenario.staged_batch(TxnId(1, 1)), TxnId(1, 1), 0),
             ("stage", scenario.staged_batch(TxnId(1, 2)), TxnId(1, 2), 0)]

    def lookup(tc: int) -> int:
        raise AtomlogError("PARTITION_LOADING", f"epochs of {tc} not known yet",
                           {"retry_after_ms": "10"})

    answers = []
    for side, decide in ((tables(False, 10), write_step.decide),
                         (tables(True, 10), decide_native)):
        group = works(specs)
        decided = decide(group, NOW, 7, None, *side, NAME, lookup)
        answers.append(([result_key(r) for w in group for r in w.results], decided[1:]))
        assert decided.accepted == [] and decided.next_offset == 7
    assert answers[0] == answers[1]
    assert answers[0][0][0][2] == "PARTITION_LOADING"


def test_owners_take_the_native_step_on_the_native_tables(tmp_path):
    from partition_server import owner as owner_module
    assert owner_module._native_decide is decide_native
    assert owner_module.TxnGuard is core.TxnGuard
    assert owner_module.TxnBuffer is core.TxnBuffer
    assert owner_module.ProducerStateTable is core.ProducerStateTable
