"""The native TxnBuffer (partition_server/rust/src/txn_buffer.rs) against the Python
reference (partition_server/txn_buffer.py), side by side.

Random operation sequences (seeded: each seed is one sequence, reproducible with
ATOMLOG_TXN_DIFF_SEEDS / the seed in the failure) drive a Python buffer and a native one
with the same calls: live writes and markers (COMMIT, ABORT, stale and future coordinator
epochs, conflicting and repeated markers, markers for transactions never seen, late writes,
invalid ids and producer fields, the open-transaction limit), replayed batches
(apply_batch: data, control, plain, anomalies, a control batch without its marker), flushes,
retention (forget_below, within and past max_read_position), reads (max_read_position,
aborted_in in and below the index, ended, open_transaction, describe, oldest_open,
count_older_than, coordinator_epochs, state) and snapshots: snapshot() bytes, restore()
with the same or lower limits, and damaged snapshots (bit flips, truncations, extensions,
well sealed but invalid). Every call's outcome must be the same — the value (by == and by
repr, so types show) or the exception (type, args, and for AtomlogError reason, message
and metadata) — and after every step the counters (`metrics`, `changes`) and the
properties. Now and then the pair is replaced by a full replay of the log (both sides) or
by a restore of a snapshot, so the sequence goes on from recovered buffers too.

The tests of the rules themselves are tests/test_txn_buffer.py's, which run on both.
"""

from __future__ import annotations

import os
import random
import struct

import crc32c
import pytest

from partition_server import native
from partition_server.record_batch import ControlMarker, ControlType, TxnId
from partition_server.txn_buffer import MarkerAction, TxnBuffer, TxnBufferLimits
from services.errors import AtomlogError
from tests.test_txn_buffer import header

NativeTxnBuffer = getattr(native.core, "TxnBuffer", None)
pytestmark = pytest.mark.skipif(NativeTxnBuffer is None,
                                reason=f"no native TxnBuffer: {native.status()}")

COMMIT, ABORT = ControlType.COMMIT, ControlType.ABORT
NOW = 1_700_000_000_000
SEEDS = int(os.environ.get("ATOMLOG_TXN_DIFF_SEEDS", "300"))
STEPS = 250


def outcome(call, *args):
    try:
        return ("ok", call(*args))
    except AtomlogError as error:
        return ("raise", AtomlogError, error.reason, error.message, error.metadata, error.args)
    except Exception as error:  # noqa: BLE001 - every exception is compared
        return ("raise", type(error), repr(error.args))


def same(mine, theirs) -> bool:
    if mine[0] == "ok":
        return theirs[0] == "ok" and mine[1] == theirs[1] and repr(mine[1]) == repr(theirs[1])
    return mine == theirs


PROPERTIES = ("changes", "metrics", "last_applied_offset", "log_start_offset", "open_count",
              "aborted_count", "aborted_index_start", "limits")


class Pair:
    """A Python and a native buffer, called alike and compared after each call."""

    def __init__(self, python, native_buffer, trace: list):
        self.py, self.native, self.trace = python, native_buffer, trace

    def call(self, name: str, *args):
        self.trace.append((name, args))
        mine = outcome(getattr(self.py, name), *args)
        theirs = outcome(getattr(self.native, name), *args)
        assert same(mine, theirs), (name, args, mine, theirs, self.trace[-30:])
        self.check_properties()
        return mine

    def check_properties(self):
        for name in PROPERTIES:
            mine, theirs = getattr(self.py, name), getattr(self.native, name)
            assert mine == theirs and repr(mine) == repr(theirs), (name, mine, theirs,
                                                                   self.trace[-30:])
        epochs = self.py.coordinator_epochs(), self.native.coordinator_epochs()
        assert list(epochs[0].items()) == list(epochs[1].items()) and repr(epochs[0]) == repr(
            epochs[1]), (epochs, self.trace[-30:])

    def check_state(self):
        self.call("state")
        self.call("describe")
        self.call("oldest_open")


def restore_both(data: bytes, limits, trace: list):
    """Both restores of `data`: the same outcome; the pair restored, or None."""
    trace.append(("restore", len(data), limits))
    mine = outcome(TxnBuffer.restore, data, limits)
    theirs = outcome(NativeTxnBuffer.restore, data, limits)
    if mine[0] != "ok":
        assert mine == theirs, (mine, theirs, trace[-30:])
        return None
    assert theirs[0] == "ok", (mine, theirs, trace[-30:])
    (python, covered), (native_buffer, native_covered) = mine[1], theirs[1]
    assert type(native_buffer) is NativeTxnBuffer and covered == native_covered
    pair = Pair(python, native_buffer, trace)
    pair.check_properties()
    pair.check_state()
    return pair, covered


def valid(txn: TxnId) -> bool:
    return 0 <= txn[0] < 1 << 32 and 0 <= txn[1] < 1 << 64 and txn != (0, 0)


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


def damaged(rng: random.Random, data: bytes) -> bytes:
    """A damaged copy of a snapshot: caught by the CRC, the length, or the value checks."""
    kind = rng.randrange(6)
    if kind == 0:
        index = rng.randrange(len(data) * 8)
        flipped = bytearray(data)
        flipped[index // 8] ^= 1 << (index % 8)
        return bytes(flipped)
    if kind == 1:
        return data[:rng.randrange(len(data))]
    if kind == 2:
        return data + bytes(rng.randrange(1, 60))
    body = bytearray(data[:-4])
    if kind == 3:  # a field of the header or of a row, resealed: the value checks
        at = rng.randrange(4, len(body))
        body[at] = rng.randrange(256)
    elif kind == 4:  # a count changed, resealed
        at = 32 + 4 * rng.randrange(4)
        count = struct.unpack_from("<I", body, at)[0] + rng.choice([-1, 1])
        struct.pack_into("<I", body, at, count % (1 << 32))
    else:  # version / reserved / covered offset
        at, layout = rng.choice([(4, "<H"), (6, "<H"), (8, "<q"), (16, "<q"), (24, "<q")])
        struct.pack_into(layout, body, at, rng.choice([0, 1, 2, 5, -1, 1 << 40]) % (
            1 << 16) if layout == "<H" else rng.choice([0, 1, 5, -1, 1 << 40]))
    return reseal(bytes(body))


class Driver:
    """One random sequence; `log` holds every batch appended live, for replays."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.trace: list = [("seed", seed)]
        rng = self.rng
        if rng.random() < 0.2:
            self.limits = None
        else:
            self.limits = TxnBufferLimits(max_open_transactions=rng.randint(1, 4),
                                          max_aborted_transactions=rng.randint(1, 4),
                                          max_remembered_commits=rng.randint(0, 3))
        self.pair = Pair(TxnBuffer(self.limits), NativeTxnBuffer(self.limits), self.trace)
        self.offset = 0  # the log end
        self.hw = 0
        self.log: list = []  # (header, marker or None)
        self.epochs = {tc: rng.randint(0, 3) for tc in (0, 1, 2)}
        self.sequences = {tc: 0 for tc in (0, 1, 2)}
        self.known: list[TxnId] = []
        self.snapshots: list[bytes] = []

    # -- choices --

    def txn(self) -> TxnId:
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            return rng.choice([TxnId(0, 0), TxnId(-1, 1), TxnId(1 << 32, 1), TxnId(1, 1 << 64),
                               TxnId(1, -1)])
        if roll < 0.3 or not self.known:
            tc = rng.choice([0, 1, 2])
            self.sequences[tc] += 1
            txn = TxnId(tc, self.sequences[tc])
            self.known.append(txn)
            return txn
        return rng.choice(self.known[-12:])

    def producer(self) -> tuple[int, int]:
        rng = self.rng
        if rng.random() < 0.03:
            return rng.choice([(-1, 0), (1 << 63, 0), (5, -1), (5, 1 << 32), (1 << 70, 0)])
        return rng.randint(0, 3), rng.choice([0, 0, 1, (1 << 32) - 1])

    def decision(self):
        rng = self.rng
        roll = rng.random()
        if roll < 0.03:
            return rng.choice([0, 1, 5, "commit"])
        return COMMIT if roll < 0.55 else ABORT

    def epoch(self, tc: int) -> int:
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            return rng.choice([-1, 1 << 64, (1 << 64) - 1])
        if roll < 0.1:
            self.epochs[tc] += 1
        delta = rng.choice([-1, 0, 0, 0, 0, 1]) if roll < 0.3 else 0
        return max(self.epochs[tc] + delta, 0)

    # -- operations --

    def write(self):
        rng, pair = self.rng, self.pair
        txn = self.txn()
        producer_id, producer_epoch = self.producer()
        checked = pair.call("check_write", txn, producer_id, producer_epoch)
        if not valid(txn):
            return  # on_data of an invalid id: a contract violation the native refuses (doc)
        records = rng.randint(1, 3)
        first, last = self.offset, self.offset + records - 1
        if rng.random() < 0.03:  # offsets that go back, or are out of range
            first, last = rng.choice([(self.offset - 1, self.offset),
                                      (self.offset + 2, self.offset),
                                      (-1, 0), (self.offset, 1 << 63)])
        elif checked[0] != "ok" and rng.random() < 0.7:
            return
        timestamp = NOW + self.offset * 10 + rng.choice([0, 0, 0, -5])
        if rng.random() < 0.01:
            timestamp = rng.choice([1 << 63, -(1 << 63) - 1])
        done = pair.call("on_data", txn, producer_id, producer_epoch, first, last, timestamp)
        if done[0] == "ok":
            if checked[0] == "ok":
                self.log.append((header(first, last - first + 1, txn=txn, producer_id=producer_id,
                                        producer_epoch=producer_epoch, append_time_ms=timestamp),
                                 None))
            self.offset = last + 1

    def marker(self):
        rng, pair = self.rng, self.pair
        txn = self.txn() if rng.random() < 0.3 else (
            rng.choice(self.pair.py.describe()).txn if self.pair.py.open_count else self.txn())
        tc = txn[0] if 0 <= txn[0] <= 2 else 0
        decision, epoch = self.decision(), self.epoch(tc)
        plan = pair.call("check_marker", txn, decision, epoch)
        if plan[0] == "ok" and plan[1].action is MarkerAction.WRITE or rng.random() < 0.05:
            if rng.random() < 0.03:
                epoch = max(epoch - 1, 0)  # a stale epoch at on_marker: assertion
            marker_offset = self.offset if rng.random() > 0.02 else self.offset - 1
            done = pair.call("on_marker", txn, decision, epoch, marker_offset)
            if done[0] == "ok" or pair.py.last_applied_offset >= self.offset:
                producer = ((plan[1].producer_id, plan[1].producer_epoch) if plan[0] == "ok"
                            else (0, 0))
                if done[0] == "ok" and isinstance(decision, ControlType):
                    self.log.append((header(marker_offset, txn=txn, control=True,
                                            producer_id=producer[0], producer_epoch=producer[1]),
                                     ControlMarker(decision, epoch)))
                self.offset = max(self.offset, pair.py.last_applied_offset + 1)

    def replayed_batch(self):
        """apply_batch on the live pair: data (anomalies too), control, plain."""
        rng, pair = self.rng, self.pair
        kind = rng.random()
        txn = self.txn()
        if not valid(txn):
            txn = TxnId(1, 1)
        records = rng.randint(1, 2)
        if kind < 0.45:
            batch = header(self.offset, records, txn=txn, producer_id=rng.randint(1, 3),
                           producer_epoch=rng.randint(0, 2), append_time_ms=NOW + self.offset)
            marker = None
        elif kind < 0.85:
            batch = header(self.offset, txn=txn, control=True, producer_id=rng.randint(0, 3))
            decision = rng.choice([COMMIT, ABORT, COMMIT, ABORT, 1])
            marker = ControlMarker(decision, self.epoch(txn[0] if txn[0] <= 2 else 0))
            if rng.random() < 0.03:
                marker = None  # assertion: a control batch needs its marker
        elif kind < 0.95:
            batch, marker = header(self.offset, records), None  # plain
        else:  # a transaction id without the transactional bit: ignored
            batch, marker = header(self.offset, records, txn=txn)._replace(attributes=0), None
        done = pair.call("apply_batch", batch, marker)
        if done[0] == "ok":
            self.log.append((batch, marker))
        self.offset = max(self.offset, pair.py.last_applied_offset + 1)

    def gap(self):
        self.offset += self.rng.randint(1, 3)  # plain batches the buffer is not told of

    def flush(self):
        self.hw = self.rng.randint(self.hw, self.offset)
        self.pair.call("on_durable", self.hw)

    def retention(self):
        rng, pair = self.rng, self.pair
        limit = pair.py.max_read_position(self.hw)
        roll = rng.random()
        if roll < 0.7:
            start = rng.randint(0, max(limit, 0))
        elif roll < 0.9:
            start = rng.randint(0, self.offset + 1)  # the cap broken
        else:
            start = rng.choice([-1, 0, 1 << 70])
        pair.call("forget_below", start)

    def reads(self):
        rng, pair = self.rng, self.pair
        for hw in (self.hw, rng.randint(0, self.offset + 2), rng.choice([-5, 1 << 70, -(1 << 70)])):
            pair.call("max_read_position", hw)
        index_start = pair.py.aborted_index_start
        for _ in range(3):
            start = rng.choice([index_start, index_start, rng.randint(0, self.offset + 1),
                                rng.randint(index_start, max(index_start, self.offset + 2)),
                                -1])
            end = rng.choice([start, start + rng.randint(0, 6), self.offset, start - 1, 1 << 80])
            pair.call("aborted_in", start, end)
        for txn in rng.sample(self.known, min(3, len(self.known))) + [TxnId(2, 10_000)]:
            pair.call("ended", txn)
            pair.call("open_transaction", txn)
        now = NOW + self.offset * 10
        pair.call("count_older_than", now, rng.choice([0, 5, 20, 100, -1]))
        pair.call("oldest_open")
        pair.call("describe")
        pair.call("coordinator_epochs")

    def snapshot(self):
        rng, pair = self.rng, self.pair
        covered = max(self.offset, pair.py.last_applied_offset + 1)
        if rng.random() < 0.05:
            covered = pair.py.last_applied_offset  # assertion
        done = pair.call("snapshot", covered)
        if done[0] != "ok":
            return
        data = done[1]
        self.snapshots = (self.snapshots + [data])[-3:]
        limits = rng.choice([self.limits, None, TxnBufferLimits(
            max_open_transactions=1, max_aborted_transactions=1, max_remembered_commits=0)])
        restored = restore_both(data, limits, self.trace)
        if restored is None:
            # Refused alike: a buffer given invalid producer fields through on_data (the
            # contract says check_write first) writes snapshots its restore refuses.
            return
        pair2, covered2 = restored
        assert covered2 == covered
        if limits == pair.py.limits or limits is None and pair.py.limits == TxnBufferLimits():
            pair2.call("snapshot", covered)
            assert pair2.py.snapshot(covered) == data  # the same rows again
        for _ in range(3):
            assert restore_both(damaged(rng, data), self.limits, self.trace) is None or True
        if rng.random() < 0.3:  # go on from the restored pair (a restart)
            self.pair, self.limits = pair2, limits
            self.offset = max(self.offset, covered)
            self.hw = min(self.hw, self.offset)

    def full_replay(self):
        """Both replays of the log from a start, compared; sometimes kept as the pair."""
        rng = self.rng
        start = rng.choice([0, self.pair.py.log_start_offset])
        pair = Pair(TxnBuffer(self.limits), NativeTxnBuffer(self.limits), self.trace)
        for batch, marker in self.log:
            if batch.base_offset >= start:
                pair.call("apply_batch", batch, marker)
        pair.call("forget_below", start)
        pair.call("on_durable", self.offset)
        pair.check_state()
        pair.call("snapshot", max(self.offset, pair.py.last_applied_offset + 1))
        if rng.random() < 0.3:
            self.pair = pair
            self.hw = self.offset = max(self.offset, pair.py.last_applied_offset + 1)

    def run(self, steps: int):
        operations = [(self.write, 30), (self.marker, 22), (self.replayed_batch, 8),
                      (self.gap, 4), (self.flush, 8), (self.retention, 3), (self.reads, 10),
                      (self.snapshot, 3), (self.full_replay, 1)]
        functions = [f for f, _ in operations]
        weights = [w for _, w in operations]
        for step in range(steps):
            self.rng.choices(functions, weights)[0]()
            if step % 10 == 0:
                self.pair.check_state()
        self.pair.check_state()
        self.full_replay()


@pytest.mark.parametrize("block", range(10))
def test_random_sequences_agree(block):
    for seed in range(block, SEEDS, 10):
        Driver(seed).run(STEPS)


def test_sequences_reach_every_outcome():
    """The generator is not vacuous: across the seeds, each kind of answer and refusal
    happened (checked on the Python side; the native one agreed at every call)."""
    seen: dict[str, int] = {}
    for seed in range(40):
        driver = Driver(1000 + seed)
        original = Pair.call

        def counting(self, name, *args, _original=original):
            result = _original(self, name, *args)
            if result[0] == "ok":
                key = name
                if name == "check_marker":
                    key += ":" + result[1].action.name + (
                        ":ended" if result[1].already_ended else "")
            elif result[1] is AtomlogError:
                key = f"{name}:{result[2]}"
            else:
                key = f"{name}:{result[1].__name__}"
            seen[key] = seen.get(key, 0) + 1
            return result

        Pair.call = counting
        try:
            driver.run(STEPS)
        finally:
            Pair.call = original
        metrics = driver.pair.py.metrics
        for field in metrics.__dataclass_fields__:
            seen["metric:" + field] = seen.get("metric:" + field, 0) + getattr(metrics, field)
    expected = [
        "check_write", "check_write:TRANSACTION_NOT_OPEN", "check_write:RESOURCE_EXHAUSTED",
        "check_write:INVALID_ARGUMENT", "check_marker:WRITE", "check_marker:NOOP",
        "check_marker:NOOP:ended", "check_marker:STALE_COORDINATOR_EPOCH",
        "check_marker:TRANSACTION_ABORTED", "check_marker:TRANSACTION_ALREADY_COMMITTED",
        "check_marker:INVALID_ARGUMENT", "check_marker:AssertionError",
        "check_marker:ValueError", "on_data", "on_data:AssertionError", "on_marker",
        "on_marker:AssertionError", "apply_batch", "apply_batch:AssertionError",
        "aborted_in", "aborted_in:OFFSET_OUT_OF_RANGE", "aborted_in:AssertionError",
        "snapshot", "snapshot:AssertionError", "forget_below", "metric:aborted_evicted_total",
        "metric:anomalies_total", "metric:open_dropped_total",
    ]
    missing = [key for key in expected if not seen.get(key)]
    assert not missing, (missing, sorted(seen))


def test_damaged_snapshots_are_refused_alike():
    """Every truncation, every extension by a byte, every bit flip of a snapshot, and
    resealed bodies with each header field changed: the same refusal (SnapshotCorrupt,
    same message) from both restores."""
    driver = Driver(7)
    driver.run(120)
    data = driver.pair.py.snapshot(max(driver.offset, driver.pair.py.last_applied_offset + 1))
    assert data == driver.pair.native.snapshot(
        max(driver.offset, driver.pair.py.last_applied_offset + 1))
    trace: list = []
    candidates = [data[:length] for length in range(len(data))] + [data + b"\0", b""]
    for index in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[index // 8] ^= 1 << (index % 8)
        candidates.append(bytes(flipped))
    body = data[:-4]
    for at, layout, values in ((0, "<4s", [b"ALPS", b"\0\0\0\0"]), (4, "<H", [0, 2, 65535]),
                               (6, "<H", [1]), (8, "<q", [-1, 0, 3]), (16, "<q", [-1, 1 << 62]),
                               (24, "<q", [-1]), (32, "<I", [7]), (36, "<I", [0, 9]),
                               (40, "<I", [1 << 31]), (44, "<I", [3])):
        for value in values:
            changed = bytearray(body)
            struct.pack_into(layout, changed, at, value)
            candidates.append(reseal(bytes(changed)))
    for candidate in candidates:
        assert restore_both(candidate, None, trace) is None
    assert restore_both(bytearray(data), None, trace) is not None  # any bytes-like


def test_native_buffer_is_a_drop_in():
    """The same public API (methods, properties, restore's classmethod), the limits as
    given, the defaults, and coordinator_epochs a read-only live view as the Python's."""
    public = {name for name in dir(TxnBuffer) if not name.startswith("_")}
    assert public <= set(dir(NativeTxnBuffer)), public - set(dir(NativeTxnBuffer))
    limits = TxnBufferLimits(max_open_transactions=2)
    assert NativeTxnBuffer(limits).limits is limits
    assert NativeTxnBuffer().limits == TxnBufferLimits() == NativeTxnBuffer(None).limits
    buffer = NativeTxnBuffer()
    view = buffer.coordinator_epochs()
    buffer.check_write(TxnId(4, 1), 1, 0)
    buffer.on_data(TxnId(4, 1), 1, 0, 0, 0, NOW)
    buffer.on_marker(TxnId(4, 1), COMMIT, 3, 1)
    assert dict(view) == {4: 3}  # live, as MappingProxyType(self._epochs)
    with pytest.raises(TypeError):
        view[4] = 5
    restored, covered = NativeTxnBuffer.restore(buffer.snapshot(2), limits)
    assert type(restored) is NativeTxnBuffer and covered == 2 and restored.limits is limits
    assert restored.ended(TxnId(4, 1)) == (COMMIT, 1)
