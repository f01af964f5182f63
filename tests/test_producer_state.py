"""The idempotent-producer state core (partition_server/producer_state.py).

A Hypothesis state machine drives clients that send, retry and reorder batches within
5 in flight, bump epochs, go idle and expire, and a coordinator that writes markers; it
compares every decision and the whole table with a simple reference model, and checks
that a full replay of the log's headers, and every snapshot plus the headers after it,
rebuild the live table. Scripted tests cover each error reason and message, sequence
wrap-around, the table limit and snapshot corruption.

Every test runs on both tables: the Python reference (producer_state.ProducerStateTable)
and the native core's copy (partition_server._native.ProducerStateTable), which is skipped
when the native core is not loaded (ATOMLOG_NATIVE=require makes that an error instead).
tests/test_native_producer_state.py compares the two step by step.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field

import crc32c
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from partition_server import native, producer_state
from partition_server.producer_state import (
    APPEND, SEQUENCE_MAX, SEQUENCE_MODULUS, SNAPSHOT_VERSION, BatchMetadata, Duplicate,
    ProducerEntry, ProducerStateTable, SnapshotCorrupt, Verdict, _ACCEPTED, _REJECTIONS,
    decode_snapshot, encode_snapshot, last_sequence_of, parse_snapshot_file_name,
    snapshot_file_name,
)
from services.errors import AtomlogError

WINDOW = 5
IDLE_EXPIRY_MS = 1_000
MAX_PRODUCERS = 3
PRODUCER_IDS = (1, 2, 3, 4)  # one more than the table holds
# Large record counts make sequences wrap past 2**31-1 within a few batches.
RECORD_COUNTS = st.sampled_from([1, 2, 3, 1 << 29, (1 << 30) + 1, SEQUENCE_MAX])
SHORT_DELAYS_MS = st.sampled_from([0, 1, 7, 300])
LONG_DELAYS_MS = st.sampled_from([300, IDLE_EXPIRY_MS, IDLE_EXPIRY_MS + 1, 3 * IDLE_EXPIRY_MS])
MAX_PENDING = 8

# The two implementations; `ProducerStateTable` (this module's global, used by every test
# and helper below) is set to each in turn by the `implementation` fixture.
PYTHON_TABLE = producer_state.ProducerStateTable
NATIVE_TABLE = getattr(native.core, "ProducerStateTable", None)
IMPLEMENTATIONS = {"python": PYTHON_TABLE, "native": NATIVE_TABLE}


def table_type_of(name: str) -> type:
    table_type = IMPLEMENTATIONS[name]
    if table_type is None:
        pytest.skip(f"the native core is not loaded: {native.status()}")
    return table_type


def pytest_generate_tests(metafunc):
    # Each test function once per implementation. (The state machines below are
    # unittest TestCases, which take no parametrized fixture: one class per table.)
    if "implementation" in metafunc.fixturenames:
        metafunc.parametrize("implementation", sorted(IMPLEMENTATIONS), indirect=True)


@pytest.fixture(autouse=True)
def implementation(request, monkeypatch):
    """Runs the test with ProducerStateTable set to the implementation of its parameter."""
    name = getattr(request, "param", "python")
    monkeypatch.setitem(globals(), "ProducerStateTable", table_type_of(name))
    return name


# ---------------------------------------------------------------------------------------
# Reference model: per producer, the list of batches accepted since its state (re)started.
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SentBatch:
    batch_id: int
    producer_id: int
    epoch: int
    base_sequence: int
    record_count: int

    @property
    def last_sequence(self) -> int:
        return (self.base_sequence + self.record_count - 1) % SEQUENCE_MODULUS


@dataclass(frozen=True)
class Accepted:
    sent: SentBatch
    base_offset: int
    timestamp_ms: int

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.sent.record_count - 1


@dataclass
class ModelProducer:
    epoch: int
    last_timestamp_ms: int
    accepted: list[Accepted] = field(default_factory=list)


class Model:
    def __init__(self) -> None:
        self.producers: dict[int, ModelProducer] = {}

    def live(self, producer_id: int, now_ms: int) -> ModelProducer | None:
        producer = self.producers.get(producer_id)
        if producer is None or now_ms - producer.last_timestamp_ms > IDLE_EXPIRY_MS:
            return None
        return producer

    def live_ids(self, now_ms: int) -> set[int]:
        return {pid for pid in self.producers if self.live(pid, now_ms)}

    def expect(self, sent: SentBatch, now_ms: int) -> tuple[str, Accepted | None]:
        producer = self.live(sent.producer_id, now_ms)
        if producer is None:
            if sent.base_sequence != 0:
                return "UNKNOWN_PRODUCER_ID", None
            if len(self.live_ids(now_ms)) >= MAX_PRODUCERS:
                return "RESOURCE_EXHAUSTED", None
            return "append", None
        if sent.epoch < producer.epoch:
            return "PRODUCER_FENCED", None
        if sent.epoch > producer.epoch:
            return ("append" if sent.base_sequence == 0 else "OUT_OF_ORDER_SEQUENCE"), None
        for old in producer.accepted[-WINDOW:]:
            if (old.sent.base_sequence, old.sent.last_sequence) == (sent.base_sequence,
                                                                     sent.last_sequence):
                return "duplicate", old
        last = producer.accepted[-1].sent.last_sequence if producer.accepted else -1
        expected = (last + 1) % SEQUENCE_MODULUS
        return ("append" if sent.base_sequence == expected else "OUT_OF_ORDER_SEQUENCE"), None

    def record_append(self, accepted: Accepted) -> None:
        sent = accepted.sent
        producer = self.live(sent.producer_id, accepted.timestamp_ms)
        if producer is None or producer.epoch != sent.epoch:
            producer = self.producers[sent.producer_id] = ModelProducer(sent.epoch, 0)
        producer.accepted.append(accepted)
        producer.last_timestamp_ms = accepted.timestamp_ms

    def record_marker(self, producer_id: int, epoch: int, now_ms: int) -> None:
        producer = self.live(producer_id, now_ms)
        if producer is None or epoch > producer.epoch:
            self.producers[producer_id] = ModelProducer(epoch, now_ms)
        elif epoch == producer.epoch:
            producer.last_timestamp_ms = now_ms

    def entries(self, now_ms: int) -> dict[int, ProducerEntry]:
        result = {}
        for pid in self.live_ids(now_ms):
            producer = self.producers[pid]
            batches = tuple(BatchMetadata(a.sent.base_sequence, a.sent.last_sequence,
                                          a.base_offset, a.last_offset, a.timestamp_ms)
                            for a in producer.accepted[-WINDOW:])
            result[pid] = ProducerEntry(pid, producer.epoch, producer.last_timestamp_ms, batches)
        return result


@dataclass
class Client:
    producer_id: int
    epoch: int = 0
    next_sequence: int = 0
    pending: list[SentBatch] = field(default_factory=list)  # sent, no answer yet
    acked: list[SentBatch] = field(default_factory=list)    # answered (a retry = lost reply)


def replay(headers, table: ProducerStateTable | None = None,
           table_type: type | None = None) -> ProducerStateTable:
    table = table or (table_type or ProducerStateTable)(MAX_PRODUCERS, IDLE_EXPIRY_MS, WINDOW)
    for header, control in headers:
        table.apply(*header, control=control)
    return table


class ProducerStateMachine(RuleBasedStateMachine):
    table_type: type = PYTHON_TABLE  # the implementation under test (a subclass: native)

    def __init__(self) -> None:
        super().__init__()
        self.table = self.table_type(MAX_PRODUCERS, IDLE_EXPIRY_MS, WINDOW)
        self.model = Model()
        self.clients = {pid: Client(pid) for pid in PRODUCER_IDS}
        self.now_ms = 1_000_000
        self.log_end = 0
        self.headers: list[tuple[tuple[int, ...], bool]] = []  # (apply args, control)
        self.snapshots: list[tuple[bytes, int, int]] = []  # (data, covered, header index)
        self.batch_ids = itertools.count()
        self.appended: dict[int, Accepted] = {}  # batch id -> its first append
        self.expected_counts = {"duplicates_total": 0, "out_of_order_total": 0,
                                "fenced_total": 0, "unknown_producer_total": 0,
                                "exhausted_total": 0}

    # -- clients ------------------------------------------------------------------------

    @rule(producer_id=st.sampled_from(PRODUCER_IDS), record_count=RECORD_COUNTS,
          delay_ms=SHORT_DELAYS_MS)
    def send_in_order(self, producer_id, record_count, delay_ms):
        """Send a new batch, then deliver the client's oldest pending batch."""
        client = self.clients[producer_id]
        self.create_batch(producer_id, record_count)
        if client.pending:
            self.now_ms += delay_ms
            self.deliver_one(client, client.pending[0])

    @rule(producer_id=st.sampled_from(PRODUCER_IDS), record_count=RECORD_COUNTS)
    def create_batch(self, producer_id, record_count):
        """Put a batch in flight without delivering it yet (at most 5 per epoch)."""
        client = self.clients[producer_id]
        in_flight = [b for b in client.pending if b.epoch == client.epoch]
        if len(in_flight) >= WINDOW or len(client.pending) >= MAX_PENDING:
            return
        client.pending.append(SentBatch(next(self.batch_ids), producer_id, client.epoch,
                                        client.next_sequence, record_count))
        client.next_sequence = (client.next_sequence + record_count) % SEQUENCE_MODULUS

    @precondition(lambda self: any(c.pending for c in self.clients.values()))
    @rule(data=st.data(), delay_ms=SHORT_DELAYS_MS)
    def deliver_any(self, data, delay_ms):
        """Deliver any pending batch: reordered within the window, or a zombie."""
        client = data.draw(st.sampled_from([c for c in self.clients.values() if c.pending]))
        self.now_ms += delay_ms
        self.deliver_one(client, data.draw(st.sampled_from(client.pending)))

    @precondition(lambda self: any(c.acked for c in self.clients.values()))
    @rule(data=st.data(), delay_ms=SHORT_DELAYS_MS)
    def retry_answered(self, data, delay_ms):
        """The reply was lost: send an answered batch again."""
        client = data.draw(st.sampled_from([c for c in self.clients.values() if c.acked]))
        self.now_ms += delay_ms
        self.send(data.draw(st.sampled_from(client.acked)))

    @rule(producer_id=st.sampled_from(PRODUCER_IDS), bump_epoch=st.booleans())
    def reset_producer(self, producer_id, bump_epoch):
        """Re-initialise with a higher epoch (old batches become zombies), or give up the
        in-flight batches and start again from sequence 0 in the same epoch."""
        client = self.clients[producer_id]
        if bump_epoch:
            client.epoch += 1
        else:
            client.pending.clear()
        client.next_sequence = 0

    # -- partition events ---------------------------------------------------------------

    @rule(delay_ms=LONG_DELAYS_MS)
    def advance_clock(self, delay_ms):
        self.now_ms += delay_ms

    @rule(producer_id=st.sampled_from(PRODUCER_IDS), bump=st.booleans())
    def write_marker(self, producer_id, bump):
        """The coordinator ends a transaction; with `bump`, it also fences the producer."""
        client = self.clients[producer_id]
        if bump:
            client.epoch += 1
            client.next_sequence = 0
        self.append_header((producer_id, client.epoch, -1, -1), 1, control=True)
        self.model.record_marker(producer_id, client.epoch, self.now_ms)

    @rule(record_count=st.integers(1, 3), control=st.booleans())
    def write_non_idempotent(self, record_count, control):
        if not control:
            assert self.table.check(0, 0, -1, record_count, self.now_ms) is APPEND
            assert self.table.check(0, 0, 5, record_count, self.now_ms) is APPEND
        self.append_header((0, 0, -1, -1), record_count, control=control)

    @rule()
    def expire(self):
        expired = self.table.expire(self.now_ms)
        live = self.model.live_ids(self.now_ms)
        assert not set(expired) & live
        assert set(self.table.entries()) == live
        replayed = replay(self.headers, table_type=self.table_type)
        replayed.expire(self.now_ms)
        assert dict(replayed.entries()) == dict(self.table.entries())

    @rule()
    def take_snapshot(self):
        data = self.table.snapshot(self.log_end)
        self.snapshots = (self.snapshots + [(data, self.log_end, len(self.headers))])[-3:]

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def table_matches_model(self):
        assert self.table.live_entries(self.now_ms) == self.model.entries(self.now_ms)

    @invariant()
    def every_remembered_batch_is_deduplicated(self):
        for pid, entry in self.model.entries(self.now_ms).items():
            for batch in entry.batches:
                count = batch.last_offset - batch.base_offset + 1
                decision = self.table.check(pid, entry.producer_epoch, batch.base_sequence,
                                            count, self.now_ms)
                assert decision == Duplicate.of(batch)
                self.expected_counts["duplicates_total"] += 1

    @invariant()
    def snapshot_of_memoized_entries_matches_a_fresh_encoding(self):
        # snapshot() re-packs only the entries changed since its last call.
        assert self.table.snapshot(self.log_end) == encode_snapshot(
            self.log_end, self.table.entries().values())

    @invariant()
    def full_replay_equals_live(self):
        replayed = replay(self.headers, table_type=self.table_type)
        assert replayed.live_entries(self.now_ms) == self.table.live_entries(self.now_ms)
        assert replayed.metrics.anomalies_total == 0

    @invariant()
    def snapshot_plus_tail_equals_live(self):
        for data, covered, index in self.snapshots:
            restored, covered_offset = self.table_type.restore(
                data, MAX_PRODUCERS, IDLE_EXPIRY_MS, WINDOW)
            assert covered_offset == covered
            replay(self.headers[index:], restored)
            assert restored.live_entries(self.now_ms) == self.table.live_entries(self.now_ms)

    @invariant()
    def counters_match(self):
        metrics = self.table.metrics
        for name, count in self.expected_counts.items():
            assert getattr(metrics, name) == count, name
        assert metrics.anomalies_total == 0
        assert self.table.last_applied_offset == self.log_end - 1

    # -- helpers ------------------------------------------------------------------------

    def deliver_one(self, client: Client, sent: SentBatch) -> None:
        outcome = self.send(sent)
        if outcome in ("append", "duplicate", "PRODUCER_FENCED"):
            client.pending.remove(sent)
        if outcome in ("append", "duplicate"):
            client.acked = (client.acked + [sent])[-2 * WINDOW:]

    def send(self, sent: SentBatch) -> str:
        expected, original = self.model.expect(sent, self.now_ms)
        try:
            decision = self.table.check(sent.producer_id, sent.epoch, sent.base_sequence,
                                        sent.record_count, self.now_ms)
        except AtomlogError as error:
            assert error.reason == expected, (error, expected)
            self.expected_counts[_COUNTER[error.reason]] += 1
            return error.reason
        if expected == "duplicate":
            assert decision == Duplicate(original.base_offset, original.last_offset,
                                         original.timestamp_ms, sent.base_sequence,
                                         sent.last_sequence)
            self.expected_counts["duplicates_total"] += 1
            return expected
        assert expected == "append" and decision is APPEND, (expected, decision)
        self.check_not_appended_twice(sent)
        accepted = Accepted(sent, self.log_end, self.now_ms)
        self.append_header((sent.producer_id, sent.epoch, sent.base_sequence,
                            sent.last_sequence), sent.record_count, control=False)
        self.model.record_append(accepted)
        self.appended.setdefault(sent.batch_id, accepted)
        return expected

    def check_not_appended_twice(self, sent: SentBatch) -> None:
        """A batch is appended again only if its first append was forgotten: the state
        expired, or it fell out of the last 5 batches (Kafka's known limits)."""
        first = self.appended.get(sent.batch_id)
        if first is None:
            return
        producer = self.model.live(sent.producer_id, self.now_ms)
        assert producer is None or first not in producer.accepted[-WINDOW:]

    def append_header(self, fields: tuple[int, int, int, int], record_count: int,
                      control: bool) -> None:
        header = (*fields, self.log_end, self.log_end + record_count - 1, self.now_ms)
        self.table.apply(*header, control=control)
        self.headers.append((header, control))
        self.log_end += record_count


_COUNTER = {"OUT_OF_ORDER_SEQUENCE": "out_of_order_total", "PRODUCER_FENCED": "fenced_total",
            "UNKNOWN_PRODUCER_ID": "unknown_producer_total",
            "RESOURCE_EXHAUSTED": "exhausted_total"}

ProducerStateMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestProducerStateMachine = ProducerStateMachine.TestCase


class NativeProducerStateMachine(ProducerStateMachine):
    """The same machine on the native table."""

    table_type = NATIVE_TABLE


NativeProducerStateMachine.TestCase.settings = ProducerStateMachine.TestCase.settings
TestNativeProducerStateMachine = pytest.mark.skipif(
    NATIVE_TABLE is None, reason=f"the native core is not loaded: {native.status()}")(
    NativeProducerStateMachine.TestCase)


# ---------------------------------------------------------------------------------------
# Scripted tests
# ---------------------------------------------------------------------------------------

NOW = 10_000


def make_table(max_producers: int = 10, window: int = WINDOW) -> ProducerStateTable:
    return ProducerStateTable(max_producers, IDLE_EXPIRY_MS, window)


def append(table: ProducerStateTable, pid: int, epoch: int, base_sequence: int,
           record_count: int, base_offset: int, now_ms: int = NOW) -> None:
    assert table.check(pid, epoch, base_sequence, record_count, now_ms) is APPEND
    table.apply(pid, epoch, base_sequence, last_sequence_of(base_sequence, record_count),
                base_offset, base_offset + record_count - 1, now_ms)


def refused(table: ProducerStateTable, *args: int) -> AtomlogError:
    before = dict(table.entries())
    with pytest.raises(AtomlogError) as caught:
        table.check(*args)
    assert dict(table.entries()) == before  # a refusal changes nothing
    return caught.value


def test_every_verdict_is_accepted_deduplicated_or_refused():
    for verdict in Verdict:
        assert (verdict in _ACCEPTED) + (verdict in _REJECTIONS) + (
            verdict is Verdict.DUPLICATE) == 1, verdict


def test_new_producer_must_start_at_zero():
    table = make_table()
    error = refused(table, 7, 0, 5, 1, NOW)
    assert error.reason == "UNKNOWN_PRODUCER_ID"
    assert str(error) == ("UNKNOWN_PRODUCER_ID: producer 7 has no state on this partition "
                          "(never seen, or idle for more than 1000 ms): expected base "
                          "sequence 0, received 5")
    assert error.metadata["expected_sequence"] == "0"
    append(table, 7, 0, 0, 3, 0)
    assert table.entry(7, NOW).last_sequence == 2
    assert table.metrics.unknown_producer_total == 1


def test_lower_epoch_is_fenced():
    table = make_table()
    append(table, 7, 2, 0, 1, 0)
    error = refused(table, 7, 1, 1, 1, NOW)
    assert error.reason == "PRODUCER_FENCED"
    assert error.message == "producer 7 epoch 1 is fenced: this partition has seen epoch 2"
    assert error.metadata == {"producer_id": "7", "producer_epoch": "1", "current_epoch": "2"}
    assert table.metrics.fenced_total == 1


def test_new_epoch_starts_sequences_afresh():
    table = make_table()
    append(table, 7, 0, 0, 10, 0)
    error = refused(table, 7, 1, 10, 1, NOW)
    assert error.reason == "OUT_OF_ORDER_SEQUENCE"
    assert error.message == ("producer 7 epoch 1 is new (previous epoch 0) and must start at "
                             "sequence 0: expected base sequence 0, received 10")
    append(table, 7, 1, 0, 2, 10)
    entry = table.entry(7, NOW)
    assert (entry.producer_epoch, entry.last_sequence, len(entry.batches)) == (1, 1, 1)
    assert refused(table, 7, 0, 10, 1, NOW).reason == "PRODUCER_FENCED"


def test_gap_is_out_of_order():
    table = make_table()
    append(table, 7, 0, 0, 3, 0)
    error = refused(table, 7, 0, 5, 1, NOW)
    assert error.reason == "OUT_OF_ORDER_SEQUENCE"
    assert error.message == ("producer 7 epoch 0: expected base sequence 3, received 5 "
                             "(a gap after sequence 2)")
    assert error.metadata["expected_sequence"] == "3"
    assert table.metrics.out_of_order_total == 1


def test_retry_of_each_of_the_last_five_returns_the_original_offsets():
    table = make_table()
    for index in range(7):  # batches of 2 records: sequences 2i..2i+1 at offsets 100+2i..
        append(table, 7, 0, 2 * index, 2, 100 + 2 * index, now_ms=NOW + index)
    for index in range(2, 7):
        decision = table.check(7, 0, 2 * index, 2, NOW + 10)
        assert decision == Duplicate(100 + 2 * index, 101 + 2 * index, NOW + index,
                                     2 * index, 2 * index + 1)
    assert table.metrics.duplicates_total == 5
    error = refused(table, 7, 0, 2, 2, NOW + 10)  # the 6th-last batch is forgotten
    assert error.reason == "OUT_OF_ORDER_SEQUENCE"
    assert error.message == ("producer 7 epoch 0: expected base sequence 14, received 2..3, "
                             "which is not one of the last 5 batches, so it cannot be "
                             "deduplicated")
    # A retry with another record count is not the same batch.
    assert refused(table, 7, 0, 12, 1, NOW).reason == "OUT_OF_ORDER_SEQUENCE"


def test_pipelined_batches_are_checked_against_applied_state():
    table = make_table()
    for index in range(5):  # five in flight, none durable yet: apply makes them count
        append(table, 7, 0, index, 1, index)
    assert table.check(7, 0, 3, 1, NOW) == Duplicate(3, 3, NOW, 3, 3)
    assert table.check(7, 0, 5, 1, NOW) is APPEND


def test_sequences_wrap_around_after_int32_max():
    table = make_table()
    append(table, 7, 0, 0, SEQUENCE_MAX, 0)  # sequences 0 .. 2**31-2
    assert table.entry(7, NOW).next_sequence == SEQUENCE_MAX
    assert last_sequence_of(SEQUENCE_MAX, 3) == 1
    append(table, 7, 0, SEQUENCE_MAX, 3, SEQUENCE_MAX)  # 2**31-1, 0, 1
    entry = table.entry(7, NOW)
    assert (entry.last_sequence, entry.next_sequence) == (1, 2)
    assert table.check(7, 0, SEQUENCE_MAX, 3, NOW) == Duplicate(
        SEQUENCE_MAX, SEQUENCE_MAX + 2, NOW, SEQUENCE_MAX, 1)
    assert "(a gap after sequence 1)" in refused(table, 7, 0, 5, 1, NOW).message
    assert "cannot be deduplicated" in refused(table, 7, 0, SEQUENCE_MAX - 10, 1, NOW).message
    append(table, 7, 0, 2, 1, SEQUENCE_MAX + 3)
    assert table.entry(7, NOW).last_sequence == 2


def test_non_idempotent_batches_always_append_and_record_nothing():
    table = make_table()
    for pid, base_sequence in ((0, -1), (0, 4), (7, -1)):
        assert table.check(pid, 0, base_sequence, 3, NOW) is APPEND
    table.apply(0, 0, 4, 6, 0, 2, NOW)
    table.apply(7, 0, -1, -1, 3, 5, NOW)
    assert table.producer_count == 0
    assert table.last_applied_offset == 5


@pytest.mark.parametrize("args, field_name", [
    ((-1, 0, 0, 1), "producer_id"), ((1, -1, 0, 1), "producer_epoch"),
    ((1, 1 << 32, 0, 1), "producer_epoch"), ((1, 0, -2, 1), "base_sequence"),
    ((1, 0, SEQUENCE_MODULUS, 1), "base_sequence"), ((1, 0, 0, 0), "record_count"),
    ((1, 0, 0, SEQUENCE_MODULUS), "record_count"),
])
def test_header_fields_out_of_range_are_invalid_arguments(args, field_name):
    error = refused(make_table(), *args, NOW)
    assert error.reason == "INVALID_ARGUMENT"
    assert error.metadata == {"field": field_name}
    assert field_name in error.message


def test_full_table_expires_idle_producers_first_then_refuses():
    table = make_table(max_producers=2)
    append(table, 1, 0, 0, 1, 0, now_ms=NOW)
    append(table, 2, 0, 0, 1, 1, now_ms=NOW + 500)
    error = refused(table, 3, 0, 0, 1, NOW + 600)
    assert error.reason == "RESOURCE_EXHAUSTED"
    assert error.message == ("partition tracks 2 producers, the limit "
                             "partition.max_producers=2, and none has been idle for more than "
                             "1000 ms: producer 3 cannot be added")
    assert error.metadata == {"limit": "partition.max_producers", "max_producers": "2",
                              "retry_after_ms": "401"}
    assert error.retriable
    assert table.check(1, 0, 1, 1, NOW + 600) is APPEND  # known producers go on
    # Producer 1 has been idle for 1001 ms: it is expired to make room.
    assert table.check(3, 0, 0, 1, NOW + 1001) is APPEND
    assert set(table.entries()) == {2}
    metrics = table.metrics
    assert (metrics.exhausted_total, metrics.expired_total) == (1, 1)


def test_a_full_table_forgets_producers_idle_past_the_eviction_bound_before_expiry():
    """Short-lived producers (one per Spark task attempt, or per job) filled the table
    with producers done for good, and new ones were refused until the oldest reached its
    day's expiry: hours. A full table now also forgets producers idle longer than the
    eviction bound (an hour by default: past any retry and any transaction's timeout)."""
    day, hour = 86_400_000, 3_600_000
    table = ProducerStateTable(3, day)
    assert table.evict_idle_ms == hour  # (and the expiry when that is shorter)
    for pid in (1, 2, 3):
        append(table, pid, 0, 0, 1, pid, now_ms=NOW + pid * 1_000)
    error = refused(table, 4, 0, 0, 1, NOW + 30_000)
    assert error.reason == "RESOURCE_EXHAUSTED"
    assert error.metadata["retry_after_ms"] == str(1_000 + hour + 1 - 30_000)
    later = NOW + 1_000 + hour + 1  # producer 1 idle just past the hour, 2 not yet
    assert table.check(4, 0, 0, 1, later) is APPEND
    assert set(table.entries()) == {2, 3}
    assert table.metrics.evicted_total == 1
    assert refused(table, 1, 0, 1, 1, later).reason == "UNKNOWN_PRODUCER_ID"  # forgotten


def test_expiry_is_logical_so_decisions_do_not_depend_on_expire_calls():
    table = make_table()
    append(table, 7, 0, 0, 3, 0, now_ms=NOW)
    assert table.entry(7, NOW + IDLE_EXPIRY_MS) is not None  # idle exactly the limit: kept
    assert table.entry(7, NOW + IDLE_EXPIRY_MS + 1) is None
    later = NOW + IDLE_EXPIRY_MS + 1
    assert refused(table, 7, 0, 3, 1, later).reason == "UNKNOWN_PRODUCER_ID"
    assert table.check(7, 0, 0, 3, later) is APPEND  # a retry after expiry appends again
    assert table.expire(NOW + IDLE_EXPIRY_MS) == []
    assert table.expire(later) == [7]
    assert table.producer_count == 0 and table.metrics.expired_total == 1


def test_replay_equals_live_across_expiry_and_wrap_around():
    live = make_table()
    append(live, 7, 0, 0, SEQUENCE_MAX, 0, now_ms=NOW)       # next sequence 2**31-1
    append(live, 7, 0, SEQUENCE_MAX, 1, SEQUENCE_MAX, now_ms=NOW)  # next sequence 0
    later = NOW + 5 * IDLE_EXPIRY_MS
    live.expire(later)
    append(live, 7, 0, 0, 1, SEQUENCE_MAX + 1, now_ms=later)  # a fresh state, not a 3rd batch
    headers = [((7, 0, 0, SEQUENCE_MAX - 1, 0, SEQUENCE_MAX - 1, NOW), False),
               ((7, 0, SEQUENCE_MAX, SEQUENCE_MAX, SEQUENCE_MAX, SEQUENCE_MAX, NOW), False),
               ((7, 0, 0, 0, SEQUENCE_MAX + 1, SEQUENCE_MAX + 1, later), False)]
    replayed = replay(headers, make_table())
    assert dict(replayed.entries()) == dict(live.entries())
    assert len(live.entry(7, later).batches) == 1
    assert replayed.metrics.anomalies_total == 0


def test_markers_carry_the_transaction_producers_epoch():
    table = make_table()
    table.apply(0, 0, -1, -1, 0, 0, NOW, control=True)  # producer id 0: ignored
    assert table.producer_count == 0
    table.apply(7, 3, -1, -1, 1, 1, NOW, control=True)  # unknown producer: epoch only
    entry = table.entry(7, NOW)
    assert (entry.producer_epoch, entry.batches, entry.last_sequence) == (3, (), -1)
    assert refused(table, 7, 2, 0, 1, NOW).reason == "PRODUCER_FENCED"
    error = refused(table, 7, 3, 4, 1, NOW)
    assert error.message == ("producer 7 epoch 3 has no batch in this epoch yet: expected "
                             "base sequence 0, received 4")
    append(table, 7, 3, 0, 2, 2)
    table.apply(7, 3, -1, -1, 4, 4, NOW + 900, control=True)  # same epoch: keeps it alive
    entry = table.entry(7, NOW + 1_500)
    assert (entry.last_timestamp_ms, entry.last_sequence) == (NOW + 900, 1)
    table.apply(7, 2, -1, -1, 5, 5, NOW + 950, control=True)  # lower epoch: ignored
    assert table.entry(7, NOW + 1_500) == entry
    table.apply(7, 4, -1, -1, 6, 6, NOW + 1_000, control=True)  # bump: batches forgotten
    entry = table.entry(7, NOW + 1_000)
    assert (entry.producer_epoch, entry.batches) == (4, ())
    assert refused(table, 7, 3, 2, 1, NOW + 1_000).reason == "PRODUCER_FENCED"


def test_apply_of_a_batch_that_does_not_follow_restarts_the_window_and_counts():
    table = make_table()
    append(table, 7, 0, 0, 3, 0)
    table.apply(7, 0, 10, 10, 3, 3, NOW)  # written under other rules: the log is the truth
    entry = table.entry(7, NOW)
    assert [b.base_sequence for b in entry.batches] == [10]
    assert table.metrics.anomalies_total == 1


def test_apply_asserts_offsets_only_grow():
    table = make_table()
    append(table, 7, 0, 0, 3, 10)
    with pytest.raises(AssertionError):
        table.apply(8, 0, 0, 0, 12, 12, NOW)


# -- snapshots --------------------------------------------------------------------------

def sample_table() -> ProducerStateTable:
    table = make_table()
    offset = 0
    for pid in (3, 1, 2):
        for index in range(pid + 4):  # producer 3 has more batches than the window
            append(table, pid, pid, index * 2, 2, offset, now_ms=NOW + offset)
            offset += 2
    table.apply(9, 1, -1, -1, offset, offset, NOW, control=True)
    return table


def test_snapshot_round_trip_and_replay_resumes_at_the_covered_offset():
    table = sample_table()
    covered = table.last_applied_offset + 1
    data = table.snapshot(covered)
    restored, covered_offset = ProducerStateTable.restore(data, 10, IDLE_EXPIRY_MS)
    assert covered_offset == covered
    assert dict(restored.entries()) == dict(table.entries())
    assert len(restored.entry(3, NOW).batches) == WINDOW
    with pytest.raises(AssertionError):  # headers below the covered offset are not replayed
        restored.apply(1, 1, 12, 13, covered - 1, covered, NOW)
    for each in (table, restored):
        append(each, 1, 1, 10, 1, covered + 5)
    assert dict(restored.entries()) == dict(table.entries())
    smaller, _ = ProducerStateTable.restore(data, 10, IDLE_EXPIRY_MS, window=2)
    assert all(len(entry.batches) <= 2 for entry in smaller.entries().values())


def test_snapshot_of_an_empty_table():
    data = make_table().snapshot(0)
    table, covered = ProducerStateTable.restore(data, 1, 1)
    assert (table.producer_count, covered, table.last_applied_offset) == (0, 0, -1)


def test_every_bit_flip_is_detected():
    data = sample_table().snapshot(1_000)
    for index in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[index // 8] ^= 1 << (index % 8)
        with pytest.raises(SnapshotCorrupt):
            decode_snapshot(bytes(flipped))
        with pytest.raises(SnapshotCorrupt):
            ProducerStateTable.restore(bytes(flipped), 10, IDLE_EXPIRY_MS)


def test_every_truncation_and_extension_is_detected():
    data = sample_table().snapshot(1_000)
    for length in range(len(data)):
        with pytest.raises(SnapshotCorrupt):
            decode_snapshot(data[:length])
        with pytest.raises(SnapshotCorrupt):
            ProducerStateTable.restore(data[:length], 10, IDLE_EXPIRY_MS)
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(data + b"\0")
    with pytest.raises(SnapshotCorrupt):
        ProducerStateTable.restore(data + b"\0", 10, IDLE_EXPIRY_MS)


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


def test_well_sealed_but_invalid_snapshots_are_refused():
    data = sample_table().snapshot(1_000)
    body = data[:-4]
    newer = body[:4] + struct.pack("<H", SNAPSHOT_VERSION + 1) + body[6:]
    with pytest.raises(SnapshotCorrupt, match="unsupported snapshot version 2"):
        decode_snapshot(reseal(newer))
    with pytest.raises(SnapshotCorrupt, match="unexpected bytes"):
        decode_snapshot(reseal(body + b"\0"))
    with pytest.raises(SnapshotCorrupt, match="not a producer-state snapshot"):
        decode_snapshot(reseal(b"XXXX" + body[4:]))
    with pytest.raises(SnapshotCorrupt, match="at or above the covered offset"):
        decode_snapshot(reseal(body[:8] + struct.pack("<q", 3) + body[16:]))
    gap = BatchMetadata(5, 5, 20, 20, NOW)
    follows = BatchMetadata(0, 0, 10, 10, NOW)
    bad = encode_snapshot(100, [ProducerEntry(1, 0, NOW, (follows, gap))])
    with pytest.raises(SnapshotCorrupt, match="batch 1 does not follow batch 0"):
        decode_snapshot(bad)


def test_restore_raises_snapshot_corrupt():
    with pytest.raises(SnapshotCorrupt, match="shorter than its header"):
        ProducerStateTable.restore(b"", 10, IDLE_EXPIRY_MS)


def test_snapshot_file_names_sort_by_offset():
    assert snapshot_file_name(42) == "00000000000000000042.producer_snapshot"
    assert parse_snapshot_file_name(snapshot_file_name(42)) == 42
    assert parse_snapshot_file_name("00000000000000000042.producer_snapshot.tmp") is None
    assert parse_snapshot_file_name("42.producer_snapshot") is None
