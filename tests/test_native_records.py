"""The native encode_record (partition_server/rust/src/records.rs) against the Python
reference (coordinator/records.py `python_encode_record`), side by side.

Seeded random records of every type (each seed prints in the test's id and replays) with
edge values: empty and longest strings of one- to four-byte UTF-8, ints at 0 and at both
ends of their fields, no targets and many, no children and many. The bytes must be the
reference's, and decode back to the record. Records whose fields were put out of their
constructors' reach (object.__setattr__) must be refused with the reference's exception
and message, or encoded as it encodes them.
"""

from __future__ import annotations

import os
import random
import struct
import sys

import pytest

from coordinator import records
from coordinator.records import (MAX_IDEMPOTENCY_KEY_BYTES, MAX_SUBSCRIPTION_BYTES,
                                 MAX_TOPIC_BYTES, MAX_TRANSACTIONAL_ID_BYTES,
                                 PRODUCER_EPOCH_LAST_ISSUED, PRODUCER_ID_MAX, TC_PARTITION_MAX,
                                 TIME_MS_MAX, TIME_MS_MIN, TIMEOUT_MS_MAX, TXN_SEQUENCE_MAX,
                                 Completed, DeadlineReset, Decided, Decision, EndCause, Opened,
                                 Prepared, Registered, SequencesReserved, Session,
                                 SessionStarted, Staging, SubscriptionPartition, TopicPartition,
                                 TxnId, decode_record, python_encode_record)
from partition_server import native

encode_native = getattr(native.core, "encode_record", None)
pytestmark = pytest.mark.skipif(encode_native is None,
                                reason=f"no native encode_record: {native.status()}")

SEEDS = int(os.environ.get("ATOMLOG_RECORDS_DIFF_SEEDS", "100"))
CHARACTERS = "az09_-.é中😀\u0000\u07ff\u0800\uffff\U00010000\U0010ffff"


def outcome(encode, record):
    try:
        return ("ok", encode(record))
    except Exception as error:  # noqa: BLE001 - every exception is compared
        return ("raise", type(error), repr(error.args))


def check(record) -> bytes:
    data = encode_native(record)
    assert type(data) is bytes
    assert data == python_encode_record(record), record
    assert decode_record(data) == record
    assert type(decode_record(data)) is type(record)
    return data


# --- Random records ------------------------------------------------------------------------

def text(rng: random.Random, max_bytes: int, empty_ok: bool = False) -> str:
    budget = rng.choice([max_bytes, rng.randrange(1, max_bytes + 1), 1, 3])
    out, size = [], 0
    while size < budget:
        char = rng.choice(CHARACTERS)
        width = len(char.encode())
        if size + width > budget:
            char, width = "x", 1
        out.append(char)
        size += width
    if empty_ok and rng.random() < 0.3:
        return ""
    return "".join(out)


def integer(rng: random.Random, low: int, high: int) -> int:
    return rng.choice([low, high, low + 1, high - 1, rng.randint(low, high),
                       rng.randint(low, min(high, low + 1000))])


def txn_id(rng: random.Random, tc_partition: int | None = None) -> TxnId:
    if tc_partition is None:
        tc_partition = integer(rng, 0, TC_PARTITION_MAX)
    return TxnId(tc_partition, integer(rng, 1, TXN_SEQUENCE_MAX))


def many(rng: random.Random) -> int:
    return rng.choice([0, 0, 1, 2, 4, 7, rng.randrange(50), rng.randrange(300)])


def targets(rng: random.Random) -> tuple[tuple, tuple]:
    topic_partitions = {TopicPartition(text(rng, MAX_TOPIC_BYTES),
                                       integer(rng, 0, (1 << 31) - 1))
                        for _ in range(many(rng))}
    subscription_partitions = {SubscriptionPartition(text(rng, MAX_TOPIC_BYTES),
                                                     integer(rng, 0, (1 << 31) - 1),
                                                     text(rng, MAX_SUBSCRIPTION_BYTES))
                               for _ in range(many(rng))}
    return tuple(topic_partitions), tuple(subscription_partitions)


def session(rng: random.Random) -> Session:
    return Session(text(rng, MAX_TRANSACTIONAL_ID_BYTES), integer(rng, 1, PRODUCER_ID_MAX),
                   integer(rng, 0, PRODUCER_EPOCH_LAST_ISSUED))


def time_ms(rng: random.Random) -> int:
    return integer(rng, TIME_MS_MIN, TIME_MS_MAX)


def opened(rng: random.Random, cls: type) -> Opened:
    txn = txn_id(rng)
    parent = (txn_id(rng, txn.tc_partition) if cls is Opened and rng.random() < 0.3
              else None)
    return cls(txn, time_ms(rng), integer(rng, 1, TIMEOUT_MS_MAX), time_ms(rng), parent,
               session(rng) if parent is None and rng.random() < 0.5 else None,
               text(rng, MAX_IDEMPOTENCY_KEY_BYTES, empty_ok=True), *targets(rng))


def registered(rng: random.Random) -> Registered:
    while True:
        topic_partitions, subscription_partitions = targets(rng)
        if topic_partitions or subscription_partitions:
            return Registered(txn_id(rng), topic_partitions, subscription_partitions)


def decided(rng: random.Random) -> Decided:
    txn = txn_id(rng)
    decision = rng.choice(list(Decision))
    cause = rng.choice(sorted(records.DECISION_CAUSES[decision], key=lambda c: c.value))
    children = list({txn_id(rng, txn.tc_partition) for _ in range(many(rng))} - {txn})
    cut = rng.randrange(len(children) + 1) if decision is Decision.COMMIT else 0
    return Decided(txn, decision, cause, time_ms(rng), tuple(children[:cut]),
                   tuple(children[cut:]))


def session_started(rng: random.Random) -> SessionStarted:
    started = session(rng)
    fields = (started.transactional_id, started.producer_id, started.producer_epoch,
              integer(rng, 1, TIMEOUT_MS_MAX), time_ms(rng))
    if rng.random() < 0.5:
        return SessionStarted(*fields)
    while True:
        previous = (integer(rng, 1, PRODUCER_ID_MAX), integer(rng, 0, PRODUCER_EPOCH_LAST_ISSUED))
        if previous != fields[1:3]:
            return SessionStarted(*fields, *previous)


MAKERS = {
    Opened: lambda rng: opened(rng, Opened),
    Staging: lambda rng: opened(rng, Staging),
    Registered: registered,
    DeadlineReset: lambda rng: DeadlineReset(txn_id(rng), time_ms(rng)),
    Prepared: lambda rng: Prepared(txn_id(rng), time_ms(rng), integer(rng, 1, TIMEOUT_MS_MAX)),
    Decided: decided,
    Completed: lambda rng: Completed(txn_id(rng), rng.choice(list(Decision)), time_ms(rng)),
    SessionStarted: session_started,
    SequencesReserved: lambda rng: SequencesReserved(integer(rng, 1, TXN_SEQUENCE_MAX)),
    # (Encoded by the reference: the native encoder hands it back, as any type it lacks.)
    records.StreamCommitted: lambda rng: records.StreamCommitted(
        text(rng, records.MAX_STREAM_BYTES), integer(rng, 0, records.ORDINAL_MAX),
        txn_id(rng), time_ms(rng)),
}
assert set(MAKERS) == set(records.RECORD_TYPES)


def test_records_encode_through_the_native_core():
    assert records.encode_record is encode_native


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_records_encode_the_same(seed):
    rng = random.Random(seed)
    for cls in MAKERS:
        for _ in range(3):
            check(MAKERS[cls](rng))


def test_edge_values_encode_the_same():
    longest = {size: "😀" * (size // 4) + "é" * (size % 4 // 2) + "x" * (size % 2)
               for size in (MAX_TOPIC_BYTES, MAX_SUBSCRIPTION_BYTES,
                            MAX_TRANSACTIONAL_ID_BYTES)}
    assert all(len(value.encode()) == size for size, value in longest.items())
    first, last = TxnId(0, 1), TxnId(TC_PARTITION_MAX, TXN_SEQUENCE_MAX)
    top = TopicPartition(longest[MAX_TOPIC_BYTES], (1 << 31) - 1)
    sub = SubscriptionPartition(longest[MAX_TOPIC_BYTES], 0, longest[MAX_SUBSCRIPTION_BYTES])
    most = tuple(TopicPartition("t", partition) for partition in range((1 << 16) - 1))
    biggest = Session(longest[MAX_TRANSACTIONAL_ID_BYTES], PRODUCER_ID_MAX,
                      PRODUCER_EPOCH_LAST_ISSUED)
    for cls in (Opened, Staging):
        check(cls(first, TIME_MS_MIN, 1, TIME_MS_MIN))
        check(cls(last, TIME_MS_MAX, TIMEOUT_MS_MAX, TIME_MS_MAX, None, biggest,
                  longest[MAX_IDEMPOTENCY_KEY_BYTES], (top,), (sub,)))
        check(cls(last, 0, 1, 0, None, None, "", most[:1000], (sub,)))
    check(Opened(TxnId(7, 2), 0, 1, 0, TxnId(7, TXN_SEQUENCE_MAX)))
    check(Registered(first, (), (sub,)))
    check(Registered(last, most, (sub,) * 1))
    check(DeadlineReset(first, TIME_MS_MIN))
    check(Prepared(last, TIME_MS_MAX, TIMEOUT_MS_MAX))
    children = tuple(TxnId(5, sequence) for sequence in range(2, 20_002))
    check(Decided(TxnId(5, 1), Decision.COMMIT, EndCause.CLIENT, 0, children[:10_000],
                  children[10_000:]))
    check(Decided(first, Decision.ABORT, EndCause.OPERATOR, TIME_MS_MIN))
    for decision in Decision:
        check(Completed(last, decision, TIME_MS_MAX))
    check(SessionStarted("t", 1, 0, 1, TIME_MS_MIN))
    check(SessionStarted(biggest.transactional_id, PRODUCER_ID_MAX, PRODUCER_EPOCH_LAST_ISSUED,
                         TIMEOUT_MS_MAX, TIME_MS_MAX, PRODUCER_ID_MAX, 0))
    check(SessionStarted("t", 1, 0, 1, 0, 1, 1))
    check(SequencesReserved(TXN_SEQUENCE_MAX))
    check(SequencesReserved(1))


def test_valid_records_encode_without_the_reference():
    """The fast path takes every record the constructors accept: no Python runs. (But
    StreamCommitted, one a streaming micro-batch, not a transaction: the reference's.)"""
    rng = random.Random(1)
    made = [MAKERS[cls](rng) for _ in range(20) for cls in MAKERS
            if cls is not records.StreamCommitted]
    called = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        for record in made:
            encode_native(record)
    finally:
        sys.setprofile(None)
    assert called == []
    sys.setprofile(profile)  # and the profile sees the reference when it is asked
    try:
        with pytest.raises(struct.error):
            encode_native(forced(SequencesReserved(1), up_to=-1))
    finally:
        sys.setprofile(None)
    assert "encode_record" in called  # python_encode_record's code


def test_a_one_call_transaction_s_records_encode_the_same():
    txn = TxnId(11, 40_000)
    partitions = tuple(TopicPartition("orders", partition) for partition in range(4))
    key = "request-1f0c4a"
    check(Staging(txn, 1_700_000_000_000, 60_000, 1_700_000_060_000, None, None, key,
                  partitions))
    check(Decided(txn, Decision.COMMIT, EndCause.CLIENT, 1_700_000_000_005))
    check(Completed(txn, Decision.COMMIT, 1_700_000_000_009))


# --- What the constructors do not check, and fields put out of their reach ------------------

def forced(record, **fields):
    for name, value in fields.items():
        object.__setattr__(record, name, value)
    return record


class SubclassOfStarted(SessionStarted):
    __slots__ = ()


class Text(str):
    def encode(self, *args, **kwargs):
        return b"other"


class Index:
    def __index__(self):
        return 7


class Ids:
    tc_partition, sequence = 3, 9


def odd_records() -> list:
    """Each a function making one record (some are big: made when their test runs)."""
    txn = TxnId(1, 2)
    top = TopicPartition("t", 1)
    return [
        lambda: None,
        lambda: 42,
        lambda: (1, 2),
        lambda: SubclassOfStarted("t", 1, 0, 1, 0),
        lambda: SubclassOfStarted("t", 1, 0, 1, 0, 2, 0),
        # txn_id is not checked by the records' constructors
        lambda: Completed(None, Decision.COMMIT, 0),
        lambda: Completed((1, 2), Decision.COMMIT, 0),
        lambda: Completed(Ids(), Decision.COMMIT, 0),
        lambda: Completed("1:2", Decision.COMMIT, 0),
        lambda: Prepared(None, 0, 1),
        lambda: Opened(None, 0, 1, 0),
        lambda: Decided(None, Decision.ABORT, EndCause.TIMEOUT, 0),
        # strings beyond the constructors' limits and the encoding's, not UTF-8, not str
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key="k" * 0xFFFF),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key="k" * 0x10000),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key="中" * 30_000),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key="\ud800"),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key=Text("key")),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key=b"key"),
        lambda: forced(Opened(txn, 0, 1, 0), idempotency_key=None),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0), transactional_id="t" * 0x10000),
        lambda: forced(Registered(txn, (top,)), topic_partitions=(tuple.__new__(
            TopicPartition, ("x" * 0x10000, 1)),)),
        lambda: forced(Registered(txn, (top,)), topic_partitions=(tuple.__new__(
            TopicPartition, ("x", 1 << 32)),)),
        lambda: forced(Registered(txn, (top,)), topic_partitions=(tuple.__new__(
            TopicPartition, ("x",)),)),
        lambda: forced(Registered(txn, (top,)), topic_partitions=(("t", 1),)),
        # counts beyond the encoding's: targets over u16
        lambda: forced(Registered(txn, (top,)), topic_partitions=tuple(
            TopicPartition("t", p) for p in range(1 << 16))),
        lambda: forced(Registered(txn, (top,)), subscription_partitions=tuple(
            SubscriptionPartition("t", p, "s") for p in range(1 << 16))),
        lambda: forced(Registered(txn, (top,)), topic_partitions=[top]),
        lambda: forced(Decided(txn, Decision.ABORT, EndCause.TIMEOUT, 0),
                       aborted_children=[TxnId(1, 3)]),
        lambda: forced(Decided(txn, Decision.ABORT, EndCause.TIMEOUT, 0),
                       aborted_children=(None, (1, 2))),
        lambda: forced(Decided(txn, Decision.ABORT, EndCause.TIMEOUT, 0),
                       aborted_children=(tuple.__new__(TxnId, (1 << 32, 1)),)),
        # ints out of their fields' ranges, or not ints
        lambda: forced(Completed(txn, Decision.COMMIT, 0), completed_ms=1 << 63),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), completed_ms=-(1 << 63) - 1),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), completed_ms=1.5),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), completed_ms=True),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), completed_ms=Index()),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), decision=1),
        lambda: forced(Completed(txn, Decision.COMMIT, 0), decision=EndCause.OPERATOR),
        lambda: forced(Prepared(txn, 0, 1), prepared_timeout_ms=1 << 32),
        lambda: forced(Prepared(txn, 0, 1), prepared_timeout_ms=-1),
        lambda: forced(Opened(txn, 0, 1, 0), session=Session("s", 1, 0), parent=(1, 2)),
        lambda: forced(Opened(txn, 0, 1, 0), session=forced(
            Session("s", 1, 0), producer_epoch=1 << 16)),
        lambda: forced(Opened(txn, 0, 1, 0), session="s"),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0), producer_epoch=-1),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0), bumped_from_producer_id=1 << 64),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0), bumped_from_producer_id=-1),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0, 2, 0), bumped_from_epoch=1 << 16),
        lambda: forced(SessionStarted("t", 1, 0, 1, 0), bumped_from_epoch=5),
        lambda: forced(SequencesReserved(1), up_to=0),
        lambda: forced(SequencesReserved(1), up_to=-1),
        lambda: forced(SequencesReserved(1), up_to=1 << 64),
    ]


@pytest.mark.parametrize("index", range(len(odd_records())))
def test_odd_records_answer_as_the_reference(index):
    record = odd_records()[index]()
    expected = outcome(python_encode_record, record)
    assert outcome(encode_native, record) == expected


def test_the_refusals_are_the_reference_s():
    txn = TxnId(1, 2)
    too_long = forced(Opened(txn, 0, 1, 0), idempotency_key="k" * 0x10000)
    with pytest.raises(AssertionError) as raised:
        encode_native(too_long)
    assert raised.value.args == (0x10000,)
    too_many = forced(Registered(txn, (TopicPartition("t", 0),)),
                      topic_partitions=tuple(TopicPartition("t", p) for p in range(1 << 16)))
    with pytest.raises(struct.error, match="65535"):
        encode_native(too_many)
    with pytest.raises(KeyError):
        encode_native(object())
