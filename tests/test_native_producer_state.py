"""The native ProducerStateTable (partition_server/rust/src/producer_state.rs) against
the Python reference (partition_server/producer_state.py), side by side.

Random operation sequences (seeded: a failure names its seed and step) drive a Python
table and a native table with the same calls: checks followed by applies as the owner
makes them, checks and applies with invalid or out-of-range values, markers, expiry,
time going forward and back, snapshots and restores (also of damaged snapshots). Every
answer is compared: the return value (APPEND by identity), or the exception (type,
args, and an AtomlogError's reason, message and metadata); and after every step the
two tables' entries (in order), counters, producer count and last applied offset.

ATOMLOG_PS_SEEDS=n runs n seeds (default 300).
"""

from __future__ import annotations

import os
import random
import struct
from types import MappingProxyType

import crc32c
import pytest

from partition_server import native, producer_state
from partition_server.producer_state import (APPEND, SEQUENCE_MAX, SEQUENCE_MODULUS,
                                             PRODUCER_EPOCH_MAX, PRODUCER_ID_MAX,
                                             SnapshotCorrupt)
from services.errors import AtomlogError

PythonTable = producer_state.ProducerStateTable
NativeTable = getattr(native.core, "ProducerStateTable", None)

pytestmark = pytest.mark.skipif(NativeTable is None,
                                reason=f"the native core is not loaded: {native.status()}")

SEEDS = int(os.environ.get("ATOMLOG_PS_SEEDS", "300"))
STEPS = 250
PIDS = (1, 2, 3, 4, 5, 6)
COUNTS = (1, 1, 2, 3, 7, 1 << 29, (1 << 30) + 1, SEQUENCE_MAX)
# Values a header or a call may carry that the ranges refuse, Rust's types included.
ODD_INTS = (-1, -2, 0, 1, SEQUENCE_MAX, SEQUENCE_MODULUS, PRODUCER_EPOCH_MAX,
            PRODUCER_EPOCH_MAX + 1, PRODUCER_ID_MAX, PRODUCER_ID_MAX + 1, -(1 << 63),
            -(1 << 63) - 1, 1 << 64, (1 << 127) - 1, 1 << 127, -(1 << 127) - 1, 1 << 200,
            -(1 << 200))


# ---------------------------------------------------------------------------------------
# Comparing answers
# ---------------------------------------------------------------------------------------

def outcome(call):
    try:
        return ("ok", call())
    except Exception as error:  # noqa: BLE001 - every exception is compared
        return ("raised", error)


def describe_error(error: BaseException):
    if isinstance(error, AtomlogError):
        return (type(error), error.reason, error.message, dict(error.metadata), str(error))
    return (type(error), repr(error.args), str(error))


def normal(value):
    if isinstance(value, MappingProxyType):
        return ("mappingproxy", list(value.items()))
    if isinstance(value, dict):
        return ("dict", list(value.items()))
    return (type(value), value)


def same(where: str, python_call, native_call):
    """Both answers, checked equal; returns the Python one's ("ok", value) or raised."""
    expected, actual = outcome(python_call), outcome(native_call)
    assert expected[0] == actual[0], (where, expected, actual)
    if expected[0] == "raised":
        assert describe_error(expected[1]) == describe_error(actual[1]), where
        return expected
    if isinstance(expected[1], PythonTable):
        assert isinstance(actual[1], NativeTable), where
        assert_same_state(where, expected[1], actual[1])
    elif expected[1] is APPEND or actual[1] is APPEND:
        assert expected[1] is APPEND and actual[1] is APPEND, (where, expected, actual)
    elif isinstance(expected[1], tuple) and expected[1] and isinstance(expected[1][0],
                                                                        PythonTable):
        assert isinstance(actual[1][0], NativeTable), where
        assert expected[1][1] == actual[1][1], where
        assert type(expected[1][1]) is type(actual[1][1]), where
    else:
        assert normal(expected[1]) == normal(actual[1]), (where, expected, actual)
    return expected


def assert_same_state(where: str, python: PythonTable, native_table) -> None:
    assert list(python.entries().items()) == list(native_table.entries().items()), where
    assert python.metrics == native_table.metrics, where
    assert type(native_table.metrics) is producer_state.ProducerStateMetrics
    assert python.producer_count == native_table.producer_count, where
    assert python.last_applied_offset == native_table.last_applied_offset, where
    for name in ("max_producers", "idle_expiry_ms", "window", "evict_idle_ms"):
        assert getattr(python, name) == getattr(native_table, name), (where, name)


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


# ---------------------------------------------------------------------------------------
# The random driver
# ---------------------------------------------------------------------------------------

class Run:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        idle = rng.choice([0, 1, 50, 1_000, 1_000, 100_000])
        evict = rng.choice([None, None, 0, idle // 2, idle])
        self.config = (rng.choice([1, 2, 3, 4, 8]), idle, rng.choice([1, 2, 5, 5, 7]), evict)
        self.python = PythonTable(*self.config)
        self.native = NativeTable(*self.config)
        self.now = rng.choice([0, 10_000, 1 << 40])
        self.log_end = 0  # next offset
        self.clients = {pid: {"epoch": 0, "next": 0, "sent": []} for pid in PIDS}
        self.snapshots: list[bytes] = []
        self.step_name = ""

    def where(self) -> str:
        return f"seed {self.seed}: {self.step_name}"

    def both(self, name: str, *args, **kwargs):
        self.step_name = f"{name}{args}{kwargs}"
        return same(self.where(), lambda: getattr(self.python, name)(*args, **kwargs),
                    lambda: getattr(self.native, name)(*args, **kwargs))

    # -- operations ---------------------------------------------------------------------

    def advance(self):
        rng = self.rng
        self.now += rng.choice([0, 0, 1, 7, 300, self.config[1], self.config[1] + 1,
                                3_600_001, -5])

    def send(self):
        """A client's batch: check, then (if APPEND) apply at the log end, as the owner."""
        rng = self.rng
        pid = rng.choice(PIDS)
        client = self.clients[pid]
        mode = rng.choice(["next", "next", "next", "retry", "zero", "gap", "bump", "old"])
        epoch, count = client["epoch"], rng.choice(COUNTS)
        if mode == "next":
            base = client["next"]
        elif mode == "retry" and client["sent"]:
            epoch, base, count = rng.choice(client["sent"][-7:])
        elif mode == "zero":
            base = 0
        elif mode == "gap":
            base = (client["next"] + rng.choice([1, 2, 1 << 30, SEQUENCE_MAX])) % SEQUENCE_MODULUS
        elif mode == "bump":
            client["epoch"] = epoch = epoch + 1
            base = client["next"] = 0
        else:
            epoch, base = max(epoch - 1, 0), client["next"]
        decision = self.both("check", pid, epoch, base, count, self.now)
        if decision[0] == "ok" and decision[1] is APPEND:
            last_sequence = (base + count - 1) % SEQUENCE_MODULUS
            self.both("apply", pid, epoch, base, last_sequence, self.log_end,
                      self.log_end + count - 1, self.now)
            self.log_end += count
            client["next"] = (last_sequence + 1) % SEQUENCE_MODULUS
            client["sent"].append((epoch, base, count))

    def odd_check(self):
        rng = self.rng
        fields = [rng.choice([rng.choice(PIDS), 0]), rng.randint(0, 3), rng.choice([0, -1, 5]),
                  rng.choice([1, 3])]
        for _ in range(rng.randint(1, 2)):
            fields[rng.randrange(4)] = rng.choice(ODD_INTS)
        now = self.now if rng.random() < 0.8 else rng.choice(ODD_INTS[:14])
        self.both("check", *fields, now)

    def marker(self):
        rng = self.rng
        pid = rng.choice(PIDS + (0,))
        client = self.clients.get(pid)
        epoch = client["epoch"] if client else 0
        change = rng.choice([0, 0, 1, -1])
        if client and change == 1:
            client["epoch"] = epoch = epoch + 1
            client["next"] = 0
        elif change == -1:
            epoch = max(epoch - 1, 0)
        sequences = rng.choice([(-1, -1), (3, 9), (1 << 40, "x")])
        self.both("apply", pid, epoch, *sequences, self.log_end, self.log_end, self.now,
                  control=rng.choice([True, 1]))
        self.log_end += 1

    def odd_apply(self):
        """An apply the log could hold (replay of other rules) or one that is wrong."""
        rng = self.rng
        pid = rng.choice(PIDS + (0,))
        base = rng.choice([-1, 0, 1, 5, SEQUENCE_MAX, rng.randrange(SEQUENCE_MODULUS)])
        count = rng.choice([1, 2, 3])
        last_sequence = (base + count - 1) % SEQUENCE_MODULUS if base >= 0 else -1
        first, last = self.log_end, self.log_end + count - 1
        timestamp = self.now
        what = rng.choice(["plain", "plain", "span", "sequence", "offsets", "below", "pid",
                           "epoch", "time", "huge"])
        epoch = rng.randint(0, 3)
        if what == "span":
            last_sequence = (last_sequence + 1) % SEQUENCE_MODULUS
        elif what == "sequence":
            base, last_sequence = rng.choice([(SEQUENCE_MODULUS, 0), (-2, 0), (0, -3),
                                               (1 << 70, 3), (0, SEQUENCE_MODULUS)])
        elif what == "offsets":
            first, last = rng.choice([(-1, 0), (last, first - 1), (-(1 << 70), 0)])
        elif what == "below":
            first = last = max(self.log_end - rng.randint(1, 3), 0)
        elif what == "pid":
            pid = rng.choice([-1, PRODUCER_ID_MAX + 1, 1 << 130, -(1 << 130)])
        elif what == "epoch":
            epoch = rng.choice([-1, PRODUCER_EPOCH_MAX + 1, 1 << 130])
        elif what == "time":
            timestamp = rng.choice([-(1 << 63) - 5, 1 << 64, -1, 0])
        elif what == "huge" and rng.random() < 0.1:
            # Offsets past the snapshot format's i64 (Python's are ints); rare, as from
            # then on every snapshot of the run is refused.
            first = max(self.log_end, (1 << 63) - rng.randint(0, 2))
            last = first + count - 1
        control = rng.random() < 0.1
        answer = self.both("apply", pid, epoch, base, last_sequence, first, last, timestamp,
                           control=control)
        if answer[0] == "ok" or self.python.last_applied_offset >= self.log_end:
            self.log_end = self.python.last_applied_offset + 1

    def expire(self):
        now = self.now + self.rng.choice([0, 0, 1_000, -1_000, 5_000_000])
        self.both("expire", now)

    def read(self):
        rng = self.rng
        now = self.now + rng.choice([0, 1, self.config[1], self.config[1] + 1, -10])
        self.both("entry", rng.choice(PIDS + (0, 99, -1, 1 << 70)), now)
        self.both("live_entries", now)
        self.both("entries")

    def snapshot_and_restore(self):
        rng = self.rng
        covered = self.python.last_applied_offset + rng.choice([1, 1, 1, 2, 100, 0, -3])
        if rng.random() < 0.05:
            covered = rng.choice([1 << 63, (1 << 63) - 1, 1 << 64])
        answer = self.both("snapshot", covered)
        if answer[0] != "ok":
            return
        data = answer[1]
        self.snapshots = (self.snapshots + [data])[-4:]
        window = rng.choice([None, 1, 2, 5, 9])
        args = (self.config[0], self.config[1]) + (() if window is None else (window,))
        restored = self.restore(data, *args)
        if restored[0] == "ok" and rng.random() < 0.3:
            # Go on with the restored tables (as after a restart): also replays the same.
            (python, covered_offset), native_answer = restored[1], self.last_native_restore
            self.python, self.native = python, native_answer[0]
            self.config = (self.config[0], self.config[1], window or 5,
                           min(3_600_000, self.config[1]))
            self.log_end = max(self.log_end, covered_offset)

    def restore(self, data, *args):
        self.step_name = f"restore({data!r}, {args})"
        result = {}

        def native_restore():
            result["native"] = NativeTable.restore(data, *args)
            return result["native"]

        answer = same(self.where(), lambda: PythonTable.restore(data, *args), native_restore)
        if answer[0] == "ok":
            python_table, native_table = answer[1][0], result["native"][0]
            assert_same_state(self.where(), python_table, native_table)
            # Read by the native decoder, not handed to the reference's (bytes only).
            assert native_table._restored_by_reference is not isinstance(data, bytes)
            self.last_native_restore = result["native"]
            # A restored table's snapshot is the same bytes (of the same covered offset).
            assert python_table.snapshot(answer[1][1]) == native_table.snapshot(answer[1][1])
        return answer

    def damaged_restore(self):
        rng = self.rng
        if not self.snapshots:
            return
        data = rng.choice(self.snapshots)
        body = data[:-4]
        kind = rng.choice(["flip", "truncate", "extend", "version", "magic", "reserved",
                           "covered", "count", "pid", "swap", "batches", "bytearray"])
        if kind == "flip":
            index = rng.randrange(len(data) * 8)
            damaged = bytearray(data)
            damaged[index // 8] ^= 1 << (index % 8)
            damaged = bytes(damaged)
        elif kind == "truncate":
            damaged = data[:rng.randrange(len(data))]
        elif kind == "extend":
            damaged = reseal(body + b"\0" * rng.randint(1, 40))
        elif kind == "version":
            damaged = reseal(body[:4] + struct.pack("<H", rng.choice([0, 2, 65535])) + body[6:])
        elif kind == "magic":
            damaged = reseal(b"ALPX" + body[4:])
        elif kind == "reserved":
            damaged = reseal(body[:6] + struct.pack("<H", 1) + body[8:])
        elif kind == "covered":
            covered = rng.choice([-1, 0, 1, struct.unpack_from("<q", body, 8)[0] - 1])
            damaged = reseal(body[:8] + struct.pack("<q", covered) + body[16:])
        elif kind == "count":
            count = struct.unpack_from("<I", body, 16)[0] + rng.choice([-1, 1, 1000])
            damaged = reseal(body[:16] + struct.pack("<I", count % (1 << 32)) + body[20:])
        elif kind == "pid" and len(body) > 20:
            damaged = reseal(body[:20] + struct.pack("<q", rng.choice([0, -5])) + body[28:])
        elif kind == "swap" and len(body) > 41:
            # The first entry's bytes written over by random ones (any field).
            position = rng.randrange(20, len(body))
            damaged = reseal(body[:position] + bytes([rng.randrange(256)]) + body[position + 1:])
        elif kind == "batches" and len(body) > 41:
            damaged = reseal(body[:40] + bytes([rng.randrange(256)]) + body[41:])
        elif kind == "bytearray":
            damaged = rng.choice([bytearray(data), memoryview(data)])
        else:
            damaged = data[:-1]
        self.restore(damaged, self.config[0], self.config[1])

    def step(self):
        rng = self.rng
        operation = rng.choices(
            [self.send, self.odd_check, self.marker, self.odd_apply, self.advance,
             self.expire, self.read, self.snapshot_and_restore, self.damaged_restore],
            weights=[40, 6, 8, 6, 12, 4, 4, 5, 5])[0]
        operation()
        assert_same_state(self.where(), self.python, self.native)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_operations_answer_alike(seed):
    run = Run(seed)
    for _ in range(STEPS):
        run.step()


# ---------------------------------------------------------------------------------------
# Scripted edges
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    (0, 1_000), (1, -1), (1, 1_000, 0), (1, 1_000, 256), (1, 1_000, 5, 1_001),
    (1, 1_000, 5, -1), (1, 1_000, 5, None), (3, 1 << 70), (3, 1 << 70, 255, 1 << 69),
    (-(1 << 130), 5), (1 << 100, 5),
])
def test_constructor_answers_alike(args):
    answer = same(f"ProducerStateTable{args}", lambda: PythonTable(*args),
                  lambda: NativeTable(*args))
    if answer[0] == "ok":
        table = NativeTable(*args)
        assert repr(table) == repr(PythonTable(*args))
        assert_same_state(str(args), PythonTable(*args), table)


def test_keyword_arguments_and_restore_signature():
    kwargs = {"max_producers": 2, "idle_expiry_ms": 10, "window": 3, "evict_idle_ms": 4}
    assert_same_state("kwargs", PythonTable(**kwargs), NativeTable(**kwargs))
    data = PythonTable(2, 10).snapshot(0)
    same("restore kwargs", lambda: PythonTable.restore(data, max_producers=2, idle_expiry_ms=10,
                                                       window=3),
         lambda: NativeTable.restore(data, max_producers=2, idle_expiry_ms=10, window=3))
    same("restore bad window", lambda: PythonTable.restore(data, 2, 10, 0),
         lambda: NativeTable.restore(data, 2, 10, 0))
    same("restore corrupt and bad window", lambda: PythonTable.restore(b"x", 2, 10, 0),
         lambda: NativeTable.restore(b"x", 2, 10, 0))


def test_answers_are_the_modules_objects():
    table = NativeTable(10, 1_000)
    assert table.check(7, 0, 0, 2, 5) is APPEND
    table.apply(7, 0, 0, 1, 0, 1, 5)
    duplicate = table.check(7, 0, 0, 2, 5)
    assert type(duplicate) is producer_state.Duplicate
    assert duplicate == producer_state.Duplicate(0, 1, 5, 0, 1)
    entry = table.entry(7, 5)
    assert type(entry) is producer_state.ProducerEntry
    assert type(entry.batches[0]) is producer_state.BatchMetadata
    assert isinstance(table.entries(), MappingProxyType)
    assert type(table.live_entries(5)) is dict
    assert type(table.metrics) is producer_state.ProducerStateMetrics
    assert table.expire(10_000) == [7]
    with pytest.raises(SnapshotCorrupt):
        NativeTable.restore(b"", 10, 1_000)


def test_snapshot_beyond_the_formats_int64_raises_as_the_reference():
    python, native_table = PythonTable(10, 1_000), NativeTable(10, 1_000)
    for table in (python, native_table):
        table.apply(7, 0, 0, 0, 1 << 63, 1 << 63, 5)
    assert_same_state("huge offset", python, native_table)
    same("snapshot", lambda: python.snapshot((1 << 63) + 1),
         lambda: native_table.snapshot((1 << 63) + 1))
    python, native_table = PythonTable(10, 1_000), NativeTable(10, 1_000)
    same("snapshot", lambda: python.snapshot(1 << 63), lambda: native_table.snapshot(1 << 63))
    for table in (python, native_table):
        table.apply(7, 0, -1, -1, 0, 0, -(1 << 63) - 1, control=True)
    same("snapshot", lambda: python.snapshot(1), lambda: native_table.snapshot(1))


def test_the_documented_differences():
    """Where the native table cannot be the reference (partition_server/rust/src/
    producer_state.rs's module doc): entries() is a copy as of the call, not a live view;
    offsets and timestamps beyond 128 bits (Python takes any int) raise OverflowError."""
    python, native_table = PythonTable(10, 1_000), NativeTable(10, 1_000)
    views = [table.entries() for table in (python, native_table)]
    for table in (python, native_table):
        table.apply(7, 0, 0, 0, 0, 0, 5)
    assert (len(views[0]), len(views[1])) == (1, 0)
    with pytest.raises(OverflowError):
        native_table.apply(7, 0, 1, 1, 1, 1, 1 << 200)
    with pytest.raises(OverflowError):
        native_table.apply(7, 0, 1, 1 << 200, 1, 1 << 200, 5)
    with pytest.raises(OverflowError):
        native_table.check(7, 0, 1, 1, 1 << 200)
    # (The first moved last_applied_offset, as the reference does before it reads the
    # timestamp; the second was refused before: its offset cannot be held.)
    assert native_table.last_applied_offset == 1
