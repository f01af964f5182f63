"""Parallel commits in the TC partition core (coordinator/core.py; docs/coordinator.md,
"Parallel commits"): a one-call transaction whose Staging record is appended while its
batches are staged, committed once both are durable.

What is checked here, on the pure core: the record and its snapshot flag; the early
reply of the commit; a failed commit logs its abort and frees its key; nothing but its
CommitTxn or a resolution decides a staging transaction (no timeout, no session fence, no
EndTxn, no operator abort); a load resolves every staging transaction exactly once and
decides it as the partitions answered; a transaction with acks names its subscription
partitions in its record and to its resolution; a promised commit whose decision append
failed is proposed again; a CommitTxn that failed leaves its transaction to a
resolution."""

from __future__ import annotations

import pytest

from coordinator.core import (
    NO_WORK, OneCallAborted, SEQUENCE_RESERVATION, State, TcPartitionCore, replay,
)
from coordinator.records import (
    Decided, Decision, EndCause, RecordCorrupt, SequencesReserved, Session, Staging,
    SubscriptionPartition, TopicPartition, TxnId, decode_record, encode_record,
)
from services.errors import AtomlogError

TC = 3
NOW = 50_000
T0, T1 = TopicPartition("t", 0), TopicPartition("t", 1)
S0 = SubscriptionPartition("in", 0, "sub")


def fresh(epoch: int = 1) -> tuple[TcPartitionCore, list]:
    """A core whose first block of sequences is reserved (a parallel commit needs that)."""
    core, log = TcPartitionCore(TC, coordinator_epoch=epoch), [SequencesReserved(
        SEQUENCE_RESERVATION)]
    core.apply(log[0])
    return core, log


def durable(core: TcPartitionCore, ready, log: list, now: int = NOW):
    """Make every append of `ready` (and of what follows from it) durable, in order."""
    for append in ready.appends:
        log.extend(append.records)
        durable(core, core.append_done(append.append_id, now), log, now)
    return ready


def begin(core: TcPartitionCore, log: list, key: str = "k", session: Session | None = None,
          timeout_ms: int = 1_000, settle: bool = True):
    ready = core.begin_one_call(NOW, timeout_ms, session, key, [T0, T1], [], parallel=True)
    assert ready.early_reply and ready.reply.parallel and ready.appends
    if settle:
        durable(core, ready, log)
    return ready


def test_the_staging_record_round_trips_and_refuses_a_parent():
    record = Staging(TxnId(TC, 9), NOW, 1_000, NOW + 1_000, None, Session("app", 5, 1), "key",
                     (T0, T1), ())
    decoded = decode_record(encode_record(record))
    assert decoded == record and type(decoded) is Staging
    with pytest.raises(ValueError):
        Staging(TxnId(TC, 9), NOW, 1_000, NOW + 1_000, TxnId(TC, 1))
    with pytest.raises(RecordCorrupt):
        decode_record(encode_record(record)[:-1])


def test_a_parallel_commit_logs_staging_with_the_stages_and_answers_before_its_decision():
    core, log = fresh(4)
    ready = begin(core, log, settle=False)
    (append,) = ready.appends
    assert [type(r) for r in append.records] == [Staging]
    assert append.records[0].topic_partitions == (T0, T1)
    durable(core, ready, log)
    txn_id = ready.reply.txn_id
    assert core.verify(txn_id, T0).state is State.OPEN and core.verify(txn_id, T1).included
    with pytest.raises(AtomlogError) as busy:  # a retry of the same key meanwhile
        core.begin_one_call(NOW, 0, None, "k", [T0], [], parallel=True)
    assert busy.value.reason == "CONCURRENT_TRANSACTIONS"
    ended = core.end_one_call(NOW + 5, txn_id)
    assert ended.early_reply and ended.reply.state is State.COMMITTING
    # Read your commit: COMMITTING from the answer on, its decision still in flight.
    assert core.status(txn_id, NOW + 5).state is State.COMMITTING
    assert core.describe(txn_id, NOW + 5).summary.state is State.COMMITTING
    again = core.begin_one_call(NOW + 5, 0, None, "k", [T0], [], parallel=True)
    assert again.reply.existing is State.COMMITTING and not again.appends
    (decision,) = ended.appends
    assert decision.records == (Decided(txn_id, Decision.COMMIT, EndCause.CLIENT, NOW + 5),)
    done = core.append_done(decision.append_id, NOW + 6)
    log.extend(decision.records)
    assert {(m.decision, m.target, m.coordinator_epoch) for m in done.markers} == {
        (Decision.COMMIT, T0, 4), (Decision.COMMIT, T1, 4)}
    again = core.begin_one_call(NOW + 7, 0, None, "k", [T0], [], parallel=True)
    assert again.reply.existing is State.COMMITTING and not again.appends
    assert replay(log, TC, coordinator_epoch=4).snapshot() == core.snapshot()


def test_a_parallel_commit_that_fails_logs_its_abort_and_frees_its_key():
    core, log = fresh()
    txn_id = begin(core, log).reply.txn_id
    failure = AtomlogError("TRANSACTION_CONFLICT", "an ack is pending elsewhere")
    ended = core.end_one_call(NOW, txn_id, failure)
    assert not ended.early_reply and ended.reply == OneCallAborted(failure)
    (append,) = ended.appends
    assert append.records == (Decided(txn_id, Decision.ABORT, EndCause.CLIENT, NOW),)
    done = core.append_done(append.append_id, NOW)
    log.extend(append.records)
    assert {m.decision for m in done.markers} == {Decision.ABORT}
    # The key is free again: a retry starts afresh, as after a presumed abort.
    retry = begin(core, log)
    assert retry.reply.txn_id != txn_id
    assert replay(log, TC, coordinator_epoch=1).snapshot() == core.snapshot()
    # Past its timeout: refused and logged as a timeout.
    late = begin(core, [], key="late").reply.txn_id
    timed_out = core.end_one_call(NOW + 1_000, late)
    assert timed_out.reply.error.reason == "TRANSACTION_TIMED_OUT"
    assert timed_out.appends[0].records[0].cause is EndCause.TIMEOUT


def test_only_its_commit_or_a_resolution_decides_a_staging_transaction():
    core, log = fresh()
    durable(core, core.init_producer_id(NOW, "app", fresh_producer_id=70), log)
    session = Session("app", 70, 0)
    txn_id = begin(core, log, session=session).reply.txn_id
    far = NOW + 60_000
    assert not any(isinstance(r, Decided) for a in core.tick(far).appends for r in a.records)
    refusals = [
        lambda: core.init_producer_id(far, "app", 0, 70, 0),
        lambda: core.end_txn(far, txn_id, Decision.ABORT, session=session),
        lambda: core.abort(far, txn_id),
        lambda: core.add_partitions(far, txn_id, [TopicPartition("u", 0)], session),
        lambda: core.abort_one_call(far, "k"),
    ]
    before = core.snapshot()
    for call in refusals:
        with pytest.raises(AtomlogError) as refused:
            call()
        assert refused.value.reason == "CONCURRENT_TRANSACTIONS"
    assert core.snapshot() == before
    # Its CommitTxn is still running (handled): no resolution is started meanwhile.
    assert core.staged_to_resolve() == []
    durable(core, core.end_one_call(far, txn_id), log, far)  # past its deadline: aborted
    assert core.status(txn_id, far).state is not State.OPEN


@pytest.mark.parametrize("staged", [True, False])
def test_a_load_resolves_each_staging_transaction_once_as_its_partitions_answer(staged):
    core, log = fresh()
    txn_id = begin(core, log, key="resolve-me").reply.txn_id
    # The owner dies; a new one loads the log, by replay and by snapshot.
    for loaded in (replay(log, TC, coordinator_epoch=2),
                   TcPartitionCore.restore(core.snapshot(), TC, coordinator_epoch=2)[0]):
        assert loaded.verify(txn_id, T0).state is State.OPEN  # "still deciding"
        assert loaded.staged_to_resolve() == [(txn_id, (T0, T1))]
        assert loaded.staged_to_resolve() == []  # once, while it is being asked
        assert loaded.resolve_staged(NOW, txn_id, None) == NO_WORK  # no answer yet
        assert loaded.staged_to_resolve() == [(txn_id, (T0, T1))]  # asked again
        ready = loaded.resolve_staged(NOW, txn_id, staged)
        (append,) = ready.appends
        decision = Decision.COMMIT if staged else Decision.ABORT
        assert [(r.txn_id, r.decision) for r in append.records] == [(txn_id, decision)]
        done = loaded.append_done(append.append_id, NOW)
        assert {(m.decision, m.coordinator_epoch) for m in done.markers} == {(decision, 2)}
        again = loaded.begin_one_call(NOW, 0, None, "resolve-me", [T0], [], parallel=True)
        if staged:  # the client's retry finds its commit
            assert again.reply.existing is State.COMMITTING
        else:  # the key is free: the retry commits afresh
            assert again.reply.existing is None and again.reply.txn_id != txn_id


def test_a_promised_commit_whose_decision_append_failed_is_proposed_again():
    core, log = fresh()
    txn_id = begin(core, log).reply.txn_id
    ended = core.end_one_call(NOW, txn_id)
    assert ended.early_reply  # the client has its answer: committed
    (append,) = ended.appends
    assert core.append_failed(append.append_id) == NO_WORK
    assert core.staged_to_resolve() == []  # promised: never asked, never aborted
    again = core.tick(NOW + 60_000)
    decisions = [r for a in again.appends for r in a.records if isinstance(r, Decided)]
    assert [(d.txn_id, d.decision) for d in decisions] == [(txn_id, Decision.COMMIT)]


def test_a_commit_call_that_failed_leaves_its_transaction_to_a_resolution():
    core, log = fresh()
    txn_id = begin(core, log).reply.txn_id
    core.release_staging(txn_id)
    assert core.staged_to_resolve() == [(txn_id, (T0, T1))]


def test_a_parallel_commit_with_acks_names_its_subscription_partitions_to_its_resolution():
    core, log = fresh()
    ready = core.begin_one_call(NOW, 1_000, None, "acks", [T0], [S0], parallel=True)
    assert ready.early_reply and ready.reply.parallel
    (append,) = ready.appends
    (record,) = append.records
    assert type(record) is Staging and record.topic_partitions == (T0,)
    assert record.subscription_partitions == (S0,)
    durable(core, ready, log)
    txn_id = ready.reply.txn_id
    # Acks alone are a parallel commit too.
    acks_only = core.begin_one_call(NOW, 1_000, None, "acks-only", [], [S0], parallel=True)
    durable(core, acks_only, log)
    only_acks = acks_only.reply.txn_id
    # The owner dies; a new one loads the log, by replay and by snapshot: each asks the
    # partition, then the subscription partition.
    for loaded in (replay(log, TC, coordinator_epoch=2),
                   TcPartitionCore.restore(core.snapshot(), TC, coordinator_epoch=2)[0]):
        assert sorted(loaded.staged_to_resolve()) == [(txn_id, (T0, S0)), (only_acks, (S0,))]
        ready = loaded.resolve_staged(NOW, txn_id, True)
        (append,) = ready.appends
        done = loaded.append_done(append.append_id, NOW)
        assert {(m.target, m.decision) for m in done.markers} == {
            (T0, Decision.COMMIT), (S0, Decision.COMMIT)}


def test_a_parallel_commit_begins_after_a_durable_reservation():
    core = TcPartitionCore(TC, coordinator_epoch=1)
    # The first of a block: the reservation alone, waited for; this one takes two rounds
    # (staged data under a sequence no durable record covers could be handed out again).
    first = core.begin_one_call(NOW, 0, None, "k", [T0], [], parallel=True)  # key unheld
    assert first.appends[0].records == (SequencesReserved(SEQUENCE_RESERVATION),)
    assert not first.early_reply and not first.reply.parallel
    durable(core, first, [])
    second = core.begin_one_call(NOW, 0, None, "k2", [T0], [], parallel=True)
    assert second.reply.parallel and type(second.appends[0].records[0]) is Staging
