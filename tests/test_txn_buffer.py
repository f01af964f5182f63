"""The transaction-buffer core (partition_server/txn_buffer.py).

A Hypothesis state machine appends transactional and plain batches, writes markers from
coordinators of several epochs (some stale, some repeated, some for transactions never
seen here), flushes, moves the log start (retention), snapshots, and crashes (losing the
tail above the high watermark) then recovers from the newest snapshot plus the log tail
or by full replay. After every step it compares the live buffer with a model computed
from the whole log: max read position, what a read_committed fetch returns, the
refusals; and snapshot + tail, and a full replay, with the live buffer. Scripted tests
cover each rule, each error, the bounds and snapshot corruption.
"""

from __future__ import annotations

import struct

import crc32c
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from partition_server.record_batch import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    BatchHeader,
    ControlMarker,
    ControlType,
    Record,
    TxnId,
    decode_control_batch,
    encode_batch,
    encode_control_batch,
    parse_header,
    with_base_offset,
)
from partition_server.txn_buffer import (
    SNAPSHOT_VERSION,
    AbortedTxn,
    MarkerAction,
    OpenTxn,
    SnapshotCorrupt,
    TxnBufferLimits,
    decode_snapshot,
    encode_snapshot,
    parse_snapshot_file_name,
    snapshot_file_name,
)
from partition_server import native
from partition_server.txn_buffer import TxnBuffer as PythonTxnBuffer
from services.errors import REASONS, AtomlogError

# Every test here runs on both implementations: the Python reference and its port in the
# native core (partition_server/rust/src/txn_buffer.rs). `TxnBuffer` is the one under
# test: the `implementation` fixture sets it for each test function, and the state
# machine takes its class as an attribute (one TestCase per implementation, at the end).
NativeTxnBuffer = getattr(native.core, "TxnBuffer", None)
IMPLEMENTATIONS = [
    pytest.param(PythonTxnBuffer, id="python"),
    pytest.param(NativeTxnBuffer, id="native", marks=pytest.mark.skipif(
        NativeTxnBuffer is None, reason=f"no native TxnBuffer: {native.status()}")),
]
TxnBuffer = PythonTxnBuffer


@pytest.fixture(autouse=True, params=IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    monkeypatch.setitem(globals(), "TxnBuffer", request.param)
    return request.param

COMMIT, ABORT = ControlType.COMMIT, ControlType.ABORT
NOW = 1_700_000_000_000
LIMITS = TxnBufferLimits(max_open_transactions=3, max_aborted_transactions=3,
                         max_remembered_commits=2)


def header(base_offset: int, record_count: int = 1, *, txn: TxnId | None = None,
           control: bool = False, producer_id: int = 0, producer_epoch: int = 0,
           append_time_ms: int = NOW) -> BatchHeader:
    attributes = (ATTR_TRANSACTIONAL if txn else 0) | (ATTR_CONTROL if control else 0)
    tc, sequence = txn or (0, 0)
    return BatchHeader(base_offset, 65, 1, append_time_ms, 0, attributes, record_count - 1,
                       record_count, NOW, NOW, producer_id, producer_epoch,
                       0 if producer_id else -1, tc, sequence)


def refused(call, *args) -> AtomlogError:
    with pytest.raises(AtomlogError) as info:
        call(*args)
    assert info.value.reason in REASONS
    return info.value


T1, T2, T3, T4 = TxnId(1, 1), TxnId(1, 2), TxnId(2, 1), TxnId(3, 7)


def write(buffer: TxnBuffer, txn: TxnId, first: int, last: int, producer_id: int = 5,
          epoch: int = 0, now_ms: int = NOW) -> None:
    buffer.check_write(txn, producer_id, epoch)
    buffer.on_data(txn, producer_id, epoch, first, last, now_ms)


def end(buffer: TxnBuffer, txn: TxnId, decision: ControlType, offset: int,
        coordinator_epoch: int = 1) -> None:
    plan = buffer.check_marker(txn, decision, coordinator_epoch)
    assert plan.action is MarkerAction.WRITE
    buffer.on_marker(txn, decision, coordinator_epoch, offset)


# ---------------------------------------------------------------------------------------
# Scripted rules
# ---------------------------------------------------------------------------------------

def test_max_read_position_is_the_oldest_open_first_offset_until_markers_are_durable():
    buffer = TxnBuffer()
    assert buffer.max_read_position(0) == 0
    write(buffer, T1, 0, 2)
    write(buffer, T2, 3, 3)
    write(buffer, T1, 4, 5)  # a second batch of T1: its first offset stays 0
    assert buffer.max_read_position(3) == 0  # min(first offset, hw)
    assert buffer.open_transaction(T1) == OpenTxn(T1, 5, 0, 0, 5, NOW)
    end(buffer, T1, COMMIT, 6)
    # The marker is not durable yet: T1 still holds the position (a crash could lose it).
    assert buffer.max_read_position(6) == 0
    buffer.on_durable(7)
    assert buffer.max_read_position(7) == 3
    end(buffer, T2, ABORT, 7)
    assert buffer.max_read_position(7) == 3
    assert buffer.max_read_position(8) == 8  # the hw passed the marker: no hold any more
    buffer.on_durable(8)
    assert buffer.max_read_position(8) == 8
    assert buffer.open_count == 0 and buffer.oldest_open() is None


def test_late_write_after_abort_or_commit_is_refused():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 0)
    write(buffer, T2, 1, 1)
    end(buffer, T1, ABORT, 2)
    end(buffer, T2, COMMIT, 3)
    error = refused(buffer.check_write, T1, 5, 0)
    assert error.reason == "TRANSACTION_NOT_OPEN"
    assert error.message == ("transaction (1, 1) was aborted on this partition (marker at "
                             "offset 2); it takes no more writes")
    assert error.metadata == {"txn_id": "(1, 1)", "marker_offset": "2"}
    assert "was committed" in refused(buffer.check_write, T2, 5, 0).message
    assert buffer.metrics.late_writes_total == 2
    buffer.check_write(T3, 6, 0)  # new transactions go on; writes to open ones too


def test_markers_write_noop_repeat_and_conflict():
    buffer = TxnBuffer()
    assert buffer.check_marker(T1, COMMIT, 1) == buffer.check_marker(T1, ABORT, 1)
    plan = buffer.check_marker(T1, COMMIT, 1)  # never seen here: nothing to write
    assert (plan.action, plan.already_ended, plan.marker_offset) == (MarkerAction.NOOP,
                                                                     False, -1)
    write(buffer, T1, 0, 0, producer_id=9, epoch=4)
    plan = buffer.check_marker(T1, COMMIT, 1)
    assert (plan.action, plan.producer_id, plan.producer_epoch) == (MarkerAction.WRITE, 9, 4)
    buffer.on_marker(T1, COMMIT, 1, 1)
    repeated = buffer.check_marker(T1, COMMIT, 1)
    assert (repeated.action, repeated.already_ended, repeated.marker_offset) == (
        MarkerAction.NOOP, True, 1)
    error = refused(buffer.check_marker, T1, ABORT, 1)
    assert error.reason == "TRANSACTION_ALREADY_COMMITTED"
    write(buffer, T2, 2, 2)
    end(buffer, T2, ABORT, 3)
    assert refused(buffer.check_marker, T2, COMMIT, 1).reason == "TRANSACTION_ABORTED"
    metrics = buffer.metrics
    assert (metrics.markers_written_total, metrics.markers_noop_total,
            metrics.conflicting_markers_total) == (2, 4, 2)


def test_stale_coordinator_epochs_are_refused_per_tc_partition():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 0)
    write(buffer, T2, 1, 1)
    write(buffer, T3, 2, 2)
    end(buffer, T1, COMMIT, 3, coordinator_epoch=5)  # a newer coordinator of TC 1
    error = refused(buffer.check_marker, T2, COMMIT, 4)  # the old one, still sending
    assert error.reason == "STALE_COORDINATOR_EPOCH"
    assert error.metadata == {"tc_partition": "1", "coordinator_epoch": "4",
                              "current_epoch": "5"}
    # Stale even for a transaction that is not open here.
    assert refused(buffer.check_marker, TxnId(1, 99), ABORT, 4).reason == \
        "STALE_COORDINATOR_EPOCH"
    end(buffer, T3, ABORT, 4, coordinator_epoch=1)  # TC 2 has its own epochs
    end(buffer, T2, COMMIT, 5, coordinator_epoch=5)  # the same epoch goes on
    assert dict(buffer.coordinator_epochs()) == {1: 5, 2: 1}
    assert buffer.metrics.stale_markers_total == 2
    # A NOOP marker with a higher epoch leaves no trace (a replay could not see it).
    assert buffer.check_marker(TxnId(2, 50), COMMIT, 9).action is MarkerAction.NOOP
    assert buffer.coordinator_epochs()[2] == 1


def test_open_transaction_limit_refuses_new_transactions_only():
    buffer = TxnBuffer(TxnBufferLimits(max_open_transactions=2))
    write(buffer, T1, 0, 0)
    write(buffer, T2, 1, 1)
    error = refused(buffer.check_write, T3, 5, 0)
    assert error.reason == "RESOURCE_EXHAUSTED" and error.retriable
    assert error.message == ("partition has 2 open transactions, the limit "
                             "partition.max_open_transactions=2: transaction (2, 1) cannot "
                             "start here until one ends")
    assert error.metadata == {"limit": "partition.max_open_transactions",
                              "max_open_transactions": "2"}
    write(buffer, T1, 2, 2)  # an open one takes more data
    end(buffer, T1, COMMIT, 3)
    write(buffer, T3, 4, 4)
    assert buffer.metrics.exhausted_total == 1


def test_transactions_are_tracked_by_id_not_by_producer_epoch():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 0, producer_id=5, epoch=1)
    write(buffer, T1, 1, 1, producer_id=5, epoch=2)  # fencing is the coordinator's job
    assert buffer.open_transaction(T1) == OpenTxn(T1, 5, 1, 0, 1, NOW)


def test_invalid_fields_are_invalid_arguments():
    buffer = TxnBuffer()
    for args in ((TxnId(0, 0), 1, 0), (TxnId(1, 1), -1, 0), (TxnId(1, 1), 1, 1 << 32)):
        assert refused(buffer.check_write, *args).reason == "INVALID_ARGUMENT"
    assert refused(buffer.check_marker, TxnId(0, 0), COMMIT, 1).reason == "INVALID_ARGUMENT"


def test_aborted_in_returns_overlapping_aborts_and_stops_early():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 9)     # long: spans everything below 30
    write(buffer, T2, 10, 11)
    end(buffer, T2, ABORT, 12)  # lso 0: T1 still open
    write(buffer, T1, 13, 14)
    end(buffer, T1, ABORT, 15)  # lso 16
    write(buffer, T3, 16, 19)
    end(buffer, T3, ABORT, 20)  # lso 21
    t2 = AbortedTxn(T2, 5, 0, 10, 12, 0)
    t1 = AbortedTxn(T1, 5, 0, 0, 15, 16)
    t3 = AbortedTxn(T3, 5, 0, 16, 20, 21)
    assert buffer.aborted_in(0, 21) == [t2, t1, t3]
    assert buffer.aborted_in(5, 6) == [t1]  # T1's data spans past T2's marker
    assert buffer.aborted_in(12, 16) == [t1]
    assert buffer.aborted_in(15, 16) == []  # T1's marker is its end
    assert buffer.aborted_in(16, 17) == [t3]
    assert buffer.aborted_in(21, 30) == []


def test_aborted_index_bound_evicts_the_oldest_and_refuses_ranges_below_it():
    buffer = TxnBuffer(TxnBufferLimits(max_aborted_transactions=2))
    offset = 0
    for sequence in range(1, 5):
        write(buffer, TxnId(1, sequence), offset, offset)
        end(buffer, TxnId(1, sequence), ABORT, offset + 1)
        offset += 2
    assert buffer.aborted_count == 2 and buffer.metrics.aborted_evicted_total == 2
    assert buffer.aborted_index_start == 4  # past the marker (3) of the last evicted one
    error = refused(buffer.aborted_in, 3, 8)
    assert error.reason == "OFFSET_OUT_OF_RANGE"
    assert error.metadata == {"aborted_index_start": "4",
                              "limit": "partition.max_aborted_transactions"}
    assert [e.txn for e in buffer.aborted_in(4, 8)] == [TxnId(1, 3), TxnId(1, 4)]
    # An evicted abort is no longer recognised: the coordinator's verification must be.
    buffer.check_write(TxnId(1, 1), 5, 0)
    with pytest.raises(AtomlogError, match="TRANSACTION_NOT_OPEN"):
        buffer.check_write(TxnId(1, 3), 5, 0)


def test_remembered_commits_are_bounded():
    buffer = TxnBuffer(TxnBufferLimits(max_remembered_commits=1))
    write(buffer, T1, 0, 0)
    write(buffer, T2, 1, 1)
    end(buffer, T1, COMMIT, 2)
    end(buffer, T2, COMMIT, 3)
    buffer.check_write(T1, 5, 0)  # forgotten
    assert refused(buffer.check_write, T2, 5, 0).reason == "TRANSACTION_NOT_OPEN"
    assert buffer.check_marker(T1, COMMIT, 1).already_ended is False


def test_forget_below_drops_what_ended_below_the_log_start():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 0)
    end(buffer, T1, ABORT, 1)
    write(buffer, T2, 2, 2)
    end(buffer, T2, COMMIT, 3)
    write(buffer, T3, 4, 4)  # aborted, with data partly below the new log start
    write(buffer, T4, 5, 5)
    write(buffer, T3, 6, 6)
    end(buffer, T3, ABORT, 7)
    buffer.on_durable(8)
    changes = buffer.changes
    buffer.forget_below(5)
    assert buffer.changes == changes + 1
    assert buffer.aborted_index_start == 5
    assert [e.txn for e in buffer.aborted_in(5, 8)] == [T3]
    buffer.check_write(T1, 5, 0)  # forgotten with its segment
    buffer.check_write(T2, 5, 0)
    assert refused(buffer.check_write, T3, 5, 0).reason == "TRANSACTION_NOT_OPEN"
    buffer.forget_below(4)  # never backwards
    assert buffer.log_start_offset == 5 and buffer.changes == changes + 1
    assert buffer.open_count == 1 and buffer.max_read_position(8) == 5


def test_describe_and_metrics_queries():
    buffer = TxnBuffer()
    write(buffer, T1, 0, 1, producer_id=7, epoch=2, now_ms=NOW)
    write(buffer, T2, 2, 2, producer_id=8, now_ms=NOW + 1_000)
    write(buffer, T1, 3, 4, producer_id=7, epoch=2, now_ms=NOW + 2_000)
    assert buffer.describe() == [OpenTxn(T1, 7, 2, 0, 4, NOW),
                                 OpenTxn(T2, 8, 0, 2, 2, NOW + 1_000)]
    assert buffer.oldest_open() == OpenTxn(T1, 7, 2, 0, 4, NOW)
    assert buffer.count_older_than(NOW + 1_500, 1_000) == 1
    assert buffer.count_older_than(NOW + 5_000, 1_000) == 2
    assert buffer.count_older_than(NOW + 1_000, 1_000) == 0


def test_replay_of_real_encoded_batches_equals_the_live_buffer():
    live, log, offset = TxnBuffer(), [], 0

    def append(batch: bytes) -> BatchHeader:
        nonlocal offset
        stamped = with_base_offset(batch, offset, NOW)
        log.append(stamped)
        parsed = parse_header(stamped)
        offset = parsed.next_offset
        return parsed

    data = append(encode_batch([Record(value=b"a"), Record(value=b"b")], producer_id=3,
                               base_sequence=0, txn=T1, timestamp_ms=NOW))
    live.check_write(T1, 3, 0)
    live.on_data(T1, 3, 0, data.base_offset, data.last_offset, NOW)
    append(encode_batch([Record(value=b"plain")], timestamp_ms=NOW))
    plan = live.check_marker(T1, ABORT, 4)
    control = append(encode_control_batch(ABORT, txn=T1, coordinator_epoch=4, timestamp_ms=NOW,
                                          producer_id=plan.producer_id,
                                          producer_epoch=plan.producer_epoch))
    live.on_marker(T1, ABORT, 4, control.base_offset)
    replayed = TxnBuffer()
    for batch in log:
        parsed = parse_header(batch)
        replayed.apply_batch(parsed, decode_control_batch(batch) if parsed.is_control else None)
    assert replayed.state() == live.state()
    assert replayed.aborted_in(0, offset) == [AbortedTxn(T1, 3, 0, 0, 3, 4)]


def test_replay_never_refuses_and_counts_anomalies():
    buffer = TxnBuffer(TxnBufferLimits(max_open_transactions=1))
    buffer.apply_batch(header(0, txn=T1))
    buffer.apply_batch(header(1, txn=T2))  # above the limit: the log is the truth
    buffer.apply_batch(header(2, txn=T1, control=True), ControlMarker(COMMIT, 3))
    buffer.apply_batch(header(3, txn=T1))  # data after its marker: reopened, counted
    assert [item.txn for item in buffer.describe()] == [T2, T1]
    assert buffer.metrics.anomalies_total == 1
    # A marker whose data was retained away: ended, with an empty data range.
    buffer.apply_batch(header(4, txn=T3, control=True, producer_id=4),
                       ControlMarker(ABORT, 2))
    assert buffer.aborted_in(4, 5) == []
    assert refused(buffer.check_write, T3, 4, 0).reason == "TRANSACTION_NOT_OPEN"
    with pytest.raises(AssertionError):
        buffer.apply_batch(header(4))  # offsets only grow


# -- snapshots --------------------------------------------------------------------------

def sample_buffer() -> TxnBuffer:
    buffer = TxnBuffer(LIMITS)
    write(buffer, T1, 0, 1, producer_id=3, epoch=1)
    write(buffer, T2, 2, 2)
    end(buffer, T2, ABORT, 3, coordinator_epoch=2)
    write(buffer, T3, 4, 4)
    end(buffer, T3, COMMIT, 5, coordinator_epoch=7)
    write(buffer, T4, 6, 6)
    buffer.on_durable(7)
    return buffer


def test_snapshot_round_trip_and_restore_resumes_at_the_covered_offset():
    buffer = sample_buffer()
    data = buffer.snapshot(7)
    restored, covered = TxnBuffer.restore(data, LIMITS)
    assert covered == 7 and restored.state() == buffer.state()
    assert restored.last_applied_offset == 6
    assert dict(restored.coordinator_epochs()) == {1: 2, 2: 7}
    with pytest.raises(AssertionError):
        restored.apply_batch(header(6, txn=T4))
    smaller, _ = TxnBuffer.restore(data, TxnBufferLimits(max_remembered_commits=0))
    smaller.check_write(T3, 5, 0)  # the commit was trimmed by the lower limit


def test_a_replayed_second_abort_unindexes_the_first_entry_in_the_snapshot_rows():
    buffer = TxnBuffer()
    buffer.apply_batch(header(0, txn=T1))
    buffer.apply_batch(header(1, txn=T1, control=True), ControlMarker(ABORT, 3))
    buffer.apply_batch(header(2, txn=T2))
    buffer.apply_batch(header(3, txn=T1))  # data after its marker: an anomaly, reopened
    buffer.apply_batch(header(4, txn=T1, control=True), ControlMarker(ABORT, 3))
    first, second = buffer.state().aborted
    assert (first[0].marker_offset, first[1]) == (1, False)
    assert (second[0].marker_offset, second[1]) == (4, True)
    data = buffer.snapshot(5)
    assert data == encode_snapshot(5, buffer.state())
    restored, _ = TxnBuffer.restore(data)
    assert restored.state() == buffer.state()
    assert restored.snapshot(5) == data  # rows rebuilt by restore, flags as written


def test_commits_forgotten_out_of_order_leave_no_trace_in_snapshots_or_limits():
    buffer = TxnBuffer(TxnBufferLimits(max_remembered_commits=50))
    offset = 0
    for round_ in range(120):  # T1 committed, its data replayed again (an anomaly), ...
        buffer.apply_batch(header(offset, txn=T1))
        buffer.apply_batch(header(offset + 1, txn=T1, control=True), ControlMarker(COMMIT, 3))
        other = TxnId(2, 100 + round_)
        buffer.apply_batch(header(offset + 2, txn=other))
        buffer.apply_batch(header(offset + 3, txn=other, control=True), ControlMarker(COMMIT, 3))
        offset += 4
        state = buffer.state()
        assert [txn for txn, _ in state.committed].count(T1) == 1
        assert len(state.committed) == min(50, round_ + 2)
        assert buffer.snapshot(offset) == encode_snapshot(offset, state)
        if TxnBuffer is PythonTxnBuffer:  # its private rows (the native keeps its own)
            rows = buffer._committed_count() - buffer._committed_head
            assert rows - len(state.committed) == buffer._committed_dead  # the dead ones
    assert buffer.metrics.anomalies_total == 119
    assert buffer.ended(T1) == (COMMIT, offset - 3)
    if TxnBuffer is PythonTxnBuffer:  # Python-only: its private rows
        assert buffer._committed_count() - buffer._committed_head <= 2 * 50 + 65
    restored, _ = TxnBuffer.restore(buffer.snapshot(offset),
                                    TxnBufferLimits(max_remembered_commits=50))
    assert restored.state() == buffer.state()
    buffer.forget_below(offset - 40)  # retention: commits with markers below go
    assert all(marker >= offset - 40 for _, marker in buffer.state().committed)
    assert buffer.snapshot(offset) == encode_snapshot(offset, buffer.state())
    alone = TxnBuffer()  # only T1, ended again and again: its old rows compacted away
    for offset in range(0, 800, 2):
        alone.apply_batch(header(offset, txn=T1))
        alone.apply_batch(header(offset + 1, txn=T1, control=True), ControlMarker(COMMIT, 3))
        if TxnBuffer is PythonTxnBuffer:  # Python-only: its private rows
            assert alone._committed_count() - alone._committed_head <= 1 + 65
    assert alone.state().committed == ((T1, 799),)
    assert alone.snapshot(800) == encode_snapshot(800, alone.state())


def test_snapshot_of_an_empty_buffer():
    restored, covered = TxnBuffer.restore(TxnBuffer().snapshot(0))
    assert covered == 0 and restored.state() == TxnBuffer().state()


def test_every_bit_flip_is_detected():
    data = sample_buffer().snapshot(7)
    for index in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[index // 8] ^= 1 << (index % 8)
        with pytest.raises(SnapshotCorrupt):
            TxnBuffer.restore(bytes(flipped))


def test_every_truncation_and_extension_is_detected():
    data = sample_buffer().snapshot(7)
    for length in range(len(data)):
        with pytest.raises(SnapshotCorrupt):
            decode_snapshot(data[:length])
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(data + b"\0")


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


def test_well_sealed_but_invalid_snapshots_are_refused():
    body = sample_buffer().snapshot(7)[:-4]
    with pytest.raises(SnapshotCorrupt, match="unsupported snapshot version 2"):
        decode_snapshot(reseal(body[:4] + struct.pack("<H", SNAPSHOT_VERSION + 1) + body[6:]))
    with pytest.raises(SnapshotCorrupt, match="not a transaction-buffer snapshot"):
        decode_snapshot(reseal(b"ALPS" + body[4:]))
    with pytest.raises(SnapshotCorrupt, match="counts say"):
        decode_snapshot(reseal(body + b"\0"))
    with pytest.raises(SnapshotCorrupt, match="offsets out of order"):  # covered offset 5
        decode_snapshot(reseal(body[:8] + struct.pack("<q", 5) + body[16:]))
    with pytest.raises(SnapshotCorrupt, match="shorter than its header"):
        TxnBuffer.restore(b"")


def test_snapshot_file_names_sort_by_offset():
    assert snapshot_file_name(42) == "00000000000000000042.txn_snapshot"
    assert parse_snapshot_file_name(snapshot_file_name(42)) == 42
    assert parse_snapshot_file_name("00000000000000000042.producer_snapshot") is None


# ---------------------------------------------------------------------------------------
# State machine against a model computed from the whole log
# ---------------------------------------------------------------------------------------

def replay(entries, buffer: TxnBuffer | None = None) -> TxnBuffer:
    buffer = buffer or TxnBuffer(LIMITS)
    for batch, marker in entries:
        buffer.apply_batch(batch, marker)
    return buffer


def same_as_replay(live: TxnBuffer, recovered: TxnBuffer, log_start: int,
                   epochs_written: dict[int, int]) -> None:
    """What a recovery that could not see the log below log_start must equal (see the
    module doc of txn_buffer): aborted entries whose data began below the log start may
    show another first offset and last stable offset; epochs may be lower."""
    mine, theirs = live.state(), recovered.state()
    assert (mine.open, mine.committed) == (theirs.open, theirs.committed)
    assert live.aborted_index_start == recovered.aborted_index_start
    assert len(mine.aborted) == len(theirs.aborted)
    for (entry, indexed), (other, other_indexed) in zip(mine.aborted, theirs.aborted):
        assert (entry.txn, entry.marker_offset, indexed) == (
            other.txn, other.marker_offset, other_indexed)
        if min(entry.first_offset, other.first_offset) >= log_start:
            # Only a cut by retention explains a difference (last_stable_offset depends on
            # other transactions, which retention may have cut).
            assert entry[:5] == other[:5]
    for tc, epoch in recovered.coordinator_epochs().items():
        assert epoch <= epochs_written[tc]


class TxnBufferMachine(RuleBasedStateMachine):
    buffer_class = PythonTxnBuffer  # the implementation under test

    def __init__(self) -> None:
        super().__init__()
        self.buffer = self.buffer_class(LIMITS)
        self.log: list[tuple[BatchHeader, ControlMarker | None]] = []  # all, even deleted
        self.log_end = 0
        self.high_watermark = 0
        self.log_start = 0
        self.next_sequence = {0: 1, 1: 1}
        self.coordinator_epochs = {0: 1, 1: 1}  # what each TC's current coordinator uses
        self.snapshots: list[tuple[bytes, int, int]] = []  # (data, covered, generation)
        # Bumped by every recovery that could not see the whole log (full replay after
        # retention, or a snapshot older than the log start): the live buffer then
        # describes retention-cut transactions as a replay does, older snapshots as they were.
        self.generation = 0

    # -- model ----------------------------------------------------------------------------

    def retained(self):
        return [(h, m) for h, m in self.log if h.base_offset >= self.log_start]

    def ending(self, txn: TxnId):
        return self.endings().get(txn)

    def endings(self) -> dict[TxnId, tuple[int, ControlType]]:
        return {h.txn: (h.base_offset, m.type) for h, m in self.log if m}

    def epochs_written(self) -> dict[int, int]:
        epochs: dict[int, int] = {}
        for h, m in self.log:
            if m:
                tc = h.txn.tc_partition
                epochs[tc] = max(epochs.get(tc, 0), m.coordinator_epoch)
        return epochs

    def remembered(self, txn: TxnId) -> bool:
        end = self.ending(txn)
        if end is None or end[0] < self.log_start:
            return False
        limit = (LIMITS.max_aborted_transactions if end[1] is ABORT
                 else LIMITS.max_remembered_commits)
        same = [h.base_offset for h, m in self.log
                if m and m.type is end[1] and h.base_offset >= self.log_start]
        return end[0] in same[-limit:] if limit else False

    def open_txns(self) -> list[TxnId]:
        endings = self.endings()
        return list({h.txn for h, m in self.log if h.txn and not m and h.txn not in endings})

    def model_max_read_position(self) -> int:
        endings, hw = self.endings(), self.high_watermark
        firsts = [h.base_offset for h, m in self.log if h.txn and not m and (
            h.txn not in endings or endings[h.txn][0] >= hw)]
        return min([hw, *firsts])

    def known_txns(self) -> list[TxnId]:
        return sorted({h.txn for h, _ in self.log if h.txn})

    # -- rules ----------------------------------------------------------------------------

    @rule(tc=st.sampled_from([0, 1]), records=st.integers(1, 3), producer_id=st.integers(1, 2))
    def write_new(self, tc, records, producer_id):
        txn = TxnId(tc, self.next_sequence[tc])
        self.next_sequence[tc] += 1
        self.write(txn, records, producer_id)

    @precondition(lambda self: self.known_txns())
    @rule(data=st.data(), records=st.integers(1, 3))
    def write_existing(self, data, records):
        self.write(data.draw(st.sampled_from(self.known_txns())), records, 1)

    @rule(records=st.integers(1, 2))
    def write_plain(self, records):
        self.append(header(self.log_end, records))

    @precondition(lambda self: self.known_txns())
    @rule(data=st.data(), decision=st.sampled_from([COMMIT, ABORT]),
          epoch_delta=st.sampled_from([-1, 0, 0, 1]))
    def marker(self, data, decision, epoch_delta):
        txn = data.draw(st.sampled_from(self.known_txns() + [TxnId(0, 999)]))
        tc = txn.tc_partition
        epoch = max(self.coordinator_epochs[tc] + epoch_delta, 0)
        self.coordinator_epochs[tc] = max(self.coordinator_epochs[tc], epoch)
        written = max((m.coordinator_epoch for h, m in self.log
                       if m and h.txn.tc_partition == tc), default=0)
        end = self.ending(txn)
        is_open = txn in self.open_txns()
        try:
            plan = self.buffer.check_marker(txn, decision, epoch)
        except AtomlogError as error:
            if error.reason == "STALE_COORDINATOR_EPOCH":
                assert epoch < self.buffer.coordinator_epochs()[tc] and epoch <= written
            else:
                assert self.remembered(txn) and end[1] is not decision and error.reason in (
                    "TRANSACTION_ABORTED", "TRANSACTION_ALREADY_COMMITTED")
            return
        assert epoch >= self.buffer.coordinator_epochs().get(tc, 0)
        if is_open:
            assert plan.action is MarkerAction.WRITE
            self.append(header(self.log_end, txn=txn, control=True,
                               producer_id=plan.producer_id,
                               producer_epoch=plan.producer_epoch),
                        ControlMarker(decision, epoch))
            self.buffer.on_marker(txn, decision, epoch, self.log_end - 1)
        else:
            assert plan.action is MarkerAction.NOOP
            assert plan.already_ended == self.remembered(txn)
            if plan.already_ended:
                assert plan.marker_offset == end[0] and end[1] is decision

    @rule()
    def flush(self):
        self.high_watermark = self.log_end
        self.buffer.on_durable(self.high_watermark)

    @rule(data=st.data())
    def retention(self, data):
        """Move the log start to a batch boundary, never past max_read_position."""
        limit = self.buffer.max_read_position(self.high_watermark)
        bounds = [h.base_offset for h, _ in self.log
                  if self.log_start < h.base_offset <= limit] + [limit]
        new_start = data.draw(st.sampled_from(bounds))
        if new_start <= self.log_start:
            return
        self.log_start = new_start
        self.buffer.forget_below(new_start)

    @precondition(lambda self: self.high_watermark == self.log_end)
    @rule()
    def take_snapshot(self):
        self.snapshots = (self.snapshots + [(self.buffer.snapshot(self.log_end),
                                             self.log_end, self.generation)])[-2:]

    @rule(use_snapshot=st.booleans())
    def crash_and_recover(self, use_snapshot):
        """kill -9: the tail above the high watermark is lost; recover from the disk."""
        self.log = [(h, m) for h, m in self.log if h.base_offset < self.high_watermark]
        self.log_end = self.high_watermark
        self.buffer, exact = self.recover(use_snapshot)
        if not exact:
            self.generation += 1  # epochs of markers below the log start are gone with them
            for tc in self.coordinator_epochs:
                self.coordinator_epochs[tc] = max(self.coordinator_epochs[tc],
                                                  self.buffer.coordinator_epochs().get(tc, 0))

    def recover(self, use_snapshot: bool) -> tuple[TxnBuffer, bool]:
        if use_snapshot and self.snapshots:
            data, covered, generation = self.snapshots[-1]
            buffer, covered_offset = self.buffer_class.restore(data, LIMITS)
            assert covered_offset == covered
            start = max(covered, self.log_start)
            replay([(h, m) for h, m in self.log if h.base_offset >= start], buffer)
            buffer.forget_below(self.log_start)
            exact = covered >= self.log_start and generation == self.generation
        else:
            buffer = replay(self.retained(), self.buffer_class(LIMITS))
            buffer.forget_below(self.log_start)
            exact = self.log_start == 0 and self.generation == 0
        buffer.on_durable(self.log_end)
        return buffer, exact

    # -- helpers --------------------------------------------------------------------------

    def write(self, txn: TxnId, records: int, producer_id: int) -> None:
        is_open = txn in self.open_txns()
        try:
            self.buffer.check_write(txn, producer_id, 0)
        except AtomlogError as error:
            if error.reason == "TRANSACTION_NOT_OPEN":
                assert self.remembered(txn)
            else:
                assert error.reason == "RESOURCE_EXHAUSTED"
                assert len(self.open_txns()) >= LIMITS.max_open_transactions and not is_open
            return
        assert is_open or not self.remembered(txn)
        assert is_open or len(self.open_txns()) < LIMITS.max_open_transactions
        if self.ending(txn) is not None:
            return  # ended, forgotten here: the coordinator's verification refuses it
        first = self.log_end
        self.append(header(first, records, txn=txn, producer_id=producer_id,
                           append_time_ms=NOW + first))
        self.buffer.on_data(txn, producer_id, 0, first, self.log_end - 1, NOW + first)

    def append(self, batch: BatchHeader, marker: ControlMarker | None = None) -> None:
        self.log.append((batch, marker))
        self.log_end = batch.next_offset

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def positions_match_the_model(self):
        assert self.buffer.max_read_position(self.high_watermark) == \
            self.model_max_read_position()
        assert {o.txn for o in self.buffer.describe()} == set(self.open_txns())
        # Plain batches need not be reported live (replay sees them: harmless).
        assert self.buffer.last_applied_offset <= self.log_end - 1

    @invariant()
    def read_committed_matches_the_model(self):
        end = self.buffer.max_read_position(self.high_watermark)
        start = self.buffer.aborted_index_start
        if start > end:
            return
        aborted = self.buffer.aborted_in(start, end)
        for entry in aborted:  # precision: each one's data range overlaps the range
            assert entry.first_offset < end and entry.marker_offset > start
        by_txn = {entry.txn: entry for entry in aborted}
        endings = self.endings()
        for batch, marker in self.log:
            if marker or not start <= batch.base_offset < end or batch.txn is None:
                continue
            entry = by_txn.get(batch.txn)
            hidden = entry is not None and entry.first_offset <= batch.base_offset < \
                entry.marker_offset
            assert hidden == (endings[batch.txn][1] is ABORT), batch

    @invariant()
    def snapshot_plus_tail_equals_live(self):
        if not self.snapshots:
            return
        durable = self.high_watermark == self.log_end
        buffer, exact = self.recover(use_snapshot=True)
        live = self.buffer
        if not durable:
            return  # the recovered one lacks the undurable tail; crash rule covers it
        live.on_durable(self.log_end)
        if exact:
            assert buffer.state() == live.state()
        else:
            same_as_replay(live, buffer, self.log_start, self.epochs_written())

    @invariant()
    def snapshot_rows_kept_as_entries_came_match_a_fresh_encoding(self):
        # snapshot() joins rows packed when each entry was added (and re-packed when an
        # aborted entry stops being its id's lookup entry); encode_snapshot packs them all
        # from state() now and checks decode(encode) == state.
        assert self.buffer.snapshot(self.log_end) == encode_snapshot(self.log_end,
                                                                     self.buffer.state())

    @invariant()
    def full_replay_equals_live(self):
        if self.high_watermark != self.log_end:
            return
        buffer, exact = self.recover(use_snapshot=False)
        self.buffer.on_durable(self.log_end)
        if exact:
            assert buffer.state() == self.buffer.state()
        else:
            same_as_replay(self.buffer, buffer, self.log_start, self.epochs_written())
        assert buffer.metrics.anomalies_total == 0


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def test_state_machine():
    """The machine on the implementation under test (a test function rather than the
    machine's unittest TestCase, so that the implementation fixture parametrizes it)."""
    machine = type(f"TxnBufferMachine_{TxnBuffer.__module__.replace('.', '_')}",
                   (TxnBufferMachine,), {"buffer_class": TxnBuffer})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)
