"""The producer-id allocator core (id_allocator/core.py), without ZooKeeper.

- Scripted interleavings: a lost reply that was applied, a lost write, a paused
  allocator (SIGSTOP past its session) whose CAS then fails, a session expiry with a
  write applied and overwritten before the re-read, exhaustion, corruption, conflicts.
- A seeded simulator: N allocators against a fake ZooKeeper with versioned CAS,
  stale follower reads, lost replies, lost and delayed writes and session expiry. Every
  block handed out must be disjoint from every other and each allocator's blocks must
  increase. Failing seeds are printed; replay one with ATOMLOG_SIM_SEED=<seed>.
- The same simulator driven by Hypothesis, which shrinks a failing schedule.
- The transition table walked whole: an illegal input raises and changes nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from id_allocator.client import BlockPool
from id_allocator.core import (ABSENT, MAX_PRODUCER_ID, TRANSITIONS, Allocation, Block,
                               BlockRecord, Done, Failed, Input, ProtocolError, Read, Request,
                               Snapshot, State, Write, backoff_bound_ms, next_znode_version, plan,
                               resolve_count, validate_requester)
from services.errors import AtomlogError

_nonces = (f"n{i}" for i in itertools.count())


def nonce() -> str:
    return next(_nonces)


class FakeZooKeeper:
    """One znode with a version and ZooKeeper's CAS rules; `history` keeps every state
    so reads can be served stale (as a follower may) but never older than a client saw."""

    def __init__(self):
        self.history: list[tuple[bytes | None, int]] = [(None, ABSENT)]

    @property
    def latest(self) -> int:
        return len(self.history) - 1

    def read(self, at: int | None = None) -> Snapshot:
        data, version = self.history[self.latest if at is None else at]
        return Snapshot.parse(data, version)

    def write(self, expected_version: int, data: bytes) -> int | None:
        """The new version, or None when the CAS fails."""
        current = self.history[-1][1]
        if current != expected_version:
            return None
        self.history.append((data, next_znode_version(expected_version)))
        return self.history[-1][1]

    def records(self) -> list[BlockRecord]:
        return [BlockRecord.from_bytes(d) for d, _ in self.history if d is not None]


def run_to_write(machine: Allocation, zk: FakeZooKeeper) -> Write | Failed:
    action = machine.start()
    assert isinstance(action, Read)
    return machine.on_read(zk.read(), nonce())


def complete(machine: Allocation, zk: FakeZooKeeper) -> Done | Failed:
    """Run a machine alone, no faults, to the end."""
    action = machine.start()
    while True:
        if isinstance(action, Read):
            action = machine.on_read(zk.read(), nonce())
        elif isinstance(action, Write):
            version = zk.write(action.expected_version, action.data)
            action = machine.on_write_conflict() if version is None else machine.on_write_ok(version)
        else:
            return action


def alloc(*counts: int, owner: str = "a", attempts: int = 16, floor: int = 0) -> Allocation:
    return Allocation(tuple(Request(c, "req") for c in counts), owner, attempts, floor)


# ------------------------------------------------------------------ scripted
def test_first_allocation_creates_the_znode_and_starts_at_one():
    zk = FakeZooKeeper()
    done = complete(alloc(1000), zk)
    assert isinstance(done, Done) and done.results == (Block(1, 1000),)
    record = zk.read().record
    assert record.last_block == Block(1, 1000) and record.owner == "a" and zk.read().version == 0
    assert json.loads(zk.history[-1][0])["version"] == 1
    second = complete(alloc(5), zk)
    assert second.results == (Block(1001, 1005),) and zk.read().version == 1


def test_one_write_serves_several_requests_in_order():
    zk = FakeZooKeeper()
    done = complete(alloc(3, 1, 10), zk)
    assert done.results == (Block(1, 3), Block(4, 4), Block(5, 14))
    record = zk.read().record
    assert record.last_block == Block(1, 14) and record.blocks == 3


def test_lost_reply_of_an_applied_write_is_proven_ours_and_issued_once():
    zk = FakeZooKeeper()
    complete(alloc(10), zk)
    machine = alloc(10)
    write = run_to_write(machine, zk)
    assert zk.write(write.expected_version, write.data) is not None  # applied ...
    action = machine.on_write_uncertain()  # ... but the reply was lost
    assert action == Read(sync=True, backoff_attempt=0) and machine.state is State.RESOLVING
    done = machine.on_read(zk.read(), nonce())
    assert isinstance(done, Done) and done.resolved_uncertain
    assert done.results == (Block(11, 20),)
    assert len(zk.history) == 3  # nothing written twice


def test_lost_write_is_not_ours_and_a_fresh_attempt_succeeds():
    zk = FakeZooKeeper()
    complete(alloc(10), zk)
    machine = alloc(10)
    lost = run_to_write(machine, zk)  # never reaches ZooKeeper
    retry = machine.on_write_uncertain()
    assert isinstance(retry, Read)
    fresh = machine.on_read(zk.read(), nonce())
    assert isinstance(fresh, Write) and fresh.record.nonce != lost.record.nonce
    # The lost write is delivered late: it wins the CAS; ours must then lose it.
    assert zk.write(lost.expected_version, lost.data) is not None
    assert zk.write(fresh.expected_version, fresh.data) is None
    again = machine.on_write_conflict()
    done = machine.on_read(zk.read(), nonce()) if isinstance(again, Read) else again
    version = zk.write(done.expected_version, done.data)
    final = machine.on_write_ok(version)
    # The late write's block [11, 20] is issued to nobody; ours comes after it.
    assert final.results == (Block(21, 30),)


def test_paused_allocator_past_its_session_fails_the_cas_and_never_issues_anothers_block():
    """SIGSTOP between read and write: the other allocator moves on; on SIGCONT the
    paused one's write carries the old version, fails, and it re-reads."""
    zk = FakeZooKeeper()
    complete(alloc(10), zk)
    paused = alloc(10, owner="a")
    stale = run_to_write(paused, zk)
    issued_by_b = [complete(alloc(10, owner="b"), zk).results[0] for _ in range(3)]
    assert zk.write(stale.expected_version, stale.data) is None  # version changed: refused
    action = paused.on_write_conflict()
    while not isinstance(action, Done):
        action = paused.on_read(zk.read(), nonce()) if isinstance(action, Read) else (
            paused.on_write_ok(zk.write(action.expected_version, action.data)))
    mine = action.results[0]
    assert stale.results[0] == Block(11, 20) and issued_by_b[0] == Block(11, 20)
    assert not any(mine.overlaps(b) for b in issued_by_b) and mine == Block(41, 50)


def test_session_expiry_with_write_applied_then_overwritten_is_not_provable():
    zk = FakeZooKeeper()
    machine = alloc(10, owner="a")
    write = run_to_write(machine, zk)
    assert zk.write(write.expected_version, write.data) == 0  # applied; session expires
    machine.on_write_uncertain()
    b_block = complete(alloc(10, owner="b"), zk).results[0]  # b writes before a re-reads
    fresh = machine.on_read(zk.read(), nonce())
    assert isinstance(fresh, Write)  # cannot prove [1, 10] was ours: not issued
    done = machine.on_write_ok(zk.write(fresh.expected_version, fresh.data))
    assert b_block == Block(11, 20) and done.results == (Block(21, 30),)


def test_unresolved_lost_reply_fails_without_a_block():
    zk = FakeZooKeeper()
    machine = alloc(10)
    write = run_to_write(machine, zk)
    zk.write(write.expected_version, write.data)
    machine.on_write_uncertain()
    failed = machine.on_unavailable("zookeeper down")
    assert isinstance(failed, Failed) and failed.error.reason == "ZOOKEEPER_UNAVAILABLE"
    assert failed.error.retriable and machine.state is State.FAILED


def test_conflicts_are_bounded_and_back_off():
    zk = FakeZooKeeper()
    machine = alloc(1, attempts=3)
    backoffs = []
    action = machine.start()
    for _ in range(3):
        write = machine.on_read(zk.read(), nonce())
        complete(alloc(1, owner="b"), zk)  # someone else wins every time
        assert zk.write(write.expected_version, write.data) is None
        action = machine.on_write_conflict()
        if isinstance(action, Read):
            backoffs.append(action.backoff_attempt)
    assert backoffs == [1, 2]
    assert isinstance(action, Failed) and action.error.reason == "ID_ALLOCATION_CONFLICT"
    assert action.error.retriable
    assert [backoff_bound_ms(n, 1, 50) for n in (0, 1, 2, 3, 7, 40)] == [0, 1, 2, 4, 50, 50]


def test_exhaustion_issues_what_fits_then_fails_fatally():
    zk = FakeZooKeeper()
    near_end = BlockRecord(Block(1, MAX_PRODUCER_ID - 5), 1, "x", "", "seed")
    zk.history.append((near_end.to_bytes(), 7))
    done = complete(alloc(10, 5), zk)
    assert isinstance(done.results[0], AtomlogError)
    assert done.results[0].reason == "PRODUCER_ID_SPACE_EXHAUSTED"
    assert done.results[1] == Block(MAX_PRODUCER_ID - 4, MAX_PRODUCER_ID)
    failed = complete(alloc(1), zk)
    assert isinstance(failed, Failed) and failed.error.reason == "PRODUCER_ID_SPACE_EXHAUSTED"
    assert not failed.error.retriable and len(zk.history) == 3  # nothing written


@pytest.mark.parametrize("data", [
    b"", b"garbage", b"[]", b'{"version": 2}',
    b'{"version":1,"last_block":{"first":0,"last":5},"blocks":1,"owner":"","requester":"","nonce":"x"}',
    b'{"version":1,"last_block":{"first":9,"last":5},"blocks":1,"owner":"","requester":"","nonce":"x"}',
    b'{"version":1,"last_block":{"first":1,"last":5},"blocks":1,"owner":3,"requester":"","nonce":"x"}',
    b'{"version":1,"last_block":{"first":1,"last":"5"},"blocks":1,"owner":"","requester":"","nonce":"x"}',
])
def test_corrupt_znode_fails_closed_and_writes_nothing(data):
    zk = FakeZooKeeper()
    zk.history.append((data, 3))
    with pytest.raises(AtomlogError) as raised:
        zk.read()
    assert raised.value.reason == "PRODUCER_ID_BLOCK_CORRUPT" and not raised.value.retriable
    machine = alloc(1)
    machine.start()
    failed = machine.on_read(raised.value, nonce())
    assert isinstance(failed, Failed) and failed.error.reason == "PRODUCER_ID_BLOCK_CORRUPT"


def test_znode_going_backwards_fails_closed():
    zk = FakeZooKeeper()  # e.g. an operator deleted the znode
    machine = alloc(1, floor=5000)
    machine.start()
    failed = machine.on_read(zk.read(), nonce())
    assert isinstance(failed, Failed) and failed.error.reason == "PRODUCER_ID_BLOCK_CORRUPT"
    assert "went backwards" in failed.error.message


def test_request_validation():
    assert resolve_count(0, 1000, 5000) == 1000
    assert resolve_count(5000, 1000, 5000) == 5000
    for bad in (-1, 5001, 2**32):
        with pytest.raises(AtomlogError) as raised:
            resolve_count(bad, 1000, 5000)
        assert raised.value.reason == "INVALID_ARGUMENT"
    assert validate_requester("é" * 64) == "é" * 64
    with pytest.raises(AtomlogError):
        validate_requester("é" * 65)
    with pytest.raises(ValueError):
        Request(0)
    for first, last in ((0, 1), (5, 4), (1, MAX_PRODUCER_ID + 1)):
        with pytest.raises(ValueError):
            Block(first, last)


def test_record_names_are_bounded():
    requests = [Request(1, f"coord-{i}") for i in range(20)]
    write = plan(Snapshot(None, ABSENT), requests, "ida-0", "n")
    assert write.record.requester.endswith(",+12 more")
    assert BlockRecord.from_bytes(write.data) == write.record


def test_znode_version_wraps_like_zookeeper():
    assert next_znode_version(ABSENT) == 0 and next_znode_version(41) == 42
    assert next_znode_version(2**31 - 1) == -(2**31)


# ------------------------------------------------------------------ transition table
def _machine_in(state: State) -> Allocation:
    zk = FakeZooKeeper()
    machine = alloc(1)
    machine.start()
    if state is State.READING:
        return machine
    write = machine.on_read(zk.read(), nonce())
    if state is State.WRITING:
        return machine
    if state is State.RESOLVING:
        machine.on_write_uncertain()
        return machine
    if state is State.DONE:
        machine.on_write_ok(zk.write(write.expected_version, write.data))
        return machine
    machine.on_unavailable("down")
    return machine


FEED: dict[Input, Callable[[Allocation], object]] = {
    Input.READ: lambda m: m.on_read(Snapshot(None, ABSENT), nonce()),
    Input.WRITE_OK: lambda m: m.on_write_ok(0),
    Input.WRITE_CONFLICT: lambda m: m.on_write_conflict(),
    Input.WRITE_UNCERTAIN: lambda m: m.on_write_uncertain(),
    Input.UNAVAILABLE: lambda m: m.on_unavailable("down"),
}


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("given", list(Input))
def test_transition_table_walked_whole(state, given):
    machine = _machine_in(state)
    assert machine.state is state
    before = (machine.state, machine.attempts, machine.conflicts, machine.pending)
    if given in TRANSITIONS[state]:
        FEED[given](machine)
        assert machine.state in TRANSITIONS[state][given]
    else:
        with pytest.raises(ProtocolError):
            FEED[given](machine)
        assert (machine.state, machine.attempts, machine.conflicts, machine.pending) == before


def test_write_ok_with_an_impossible_version_is_refused_unchanged():
    machine = _machine_in(State.WRITING)
    with pytest.raises(ProtocolError):
        machine.on_write_ok(7)
    assert machine.state is State.WRITING


# ------------------------------------------------------------------ simulator
@dataclass
class Op:
    kind: str  # "read" | "write"
    sync: bool = False
    write: Write | None = None
    applied: bool = False
    result: object = None  # snapshot index (read) or new version / None (write)
    index: int = 0  # where a successful write landed in the history


@dataclass
class SimAllocator:
    name: str
    counts: list[int]
    machine: Allocation | None = None
    op: Op | None = None
    seen: int = 0  # highest history index this client has seen (ZooKeeper's zxid rule)
    floor: int = 0
    issued: list[Block] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class Simulation:
    """N allocators, one fake ZooKeeper, a scheduler that picks every next event."""

    def __init__(self, choose: Callable[[int], int], allocators: int, requests: int,
                 faults: bool, cas_max_attempts: int = 16):
        self.choose = choose
        self.zk = FakeZooKeeper()
        self.faults = faults
        self.cas_max_attempts = cas_max_attempts
        self.allocators = [SimAllocator(f"ida-{i}", [1 + (i + r) % 3 * 7 for r in range(requests)])
                           for i in range(allocators)]
        self.zombies: list[Write] = []  # writes reported lost that may still be applied
        self.trace: list[str] = []
        self.stats = {"resolved_ours": 0, "resolved_not_ours": 0, "conflicts": 0,
                      "zombie_writes_won": 0, "stale_reads": 0}

    def events(self) -> list[tuple[str, SimAllocator | None]]:
        events: list[tuple[str, SimAllocator | None]] = []
        for a in self.allocators:
            if a.machine is None and a.counts:
                events += [("start", a)] * 2
            elif a.op is not None and not a.op.applied:
                events += [("apply", a)] * 12
                if self.faults:
                    events += [("drop_request", a), ("delay_request", a), ("expire", a)]
            elif a.op is not None:
                events += [("reply", a)] * 12
                if self.faults:
                    events += [("drop_reply", a), ("expire", a)]
        if self.zombies:
            events.append(("apply_zombie", None))
        return events

    def run(self, max_steps: int = 5_000) -> None:
        for _ in range(max_steps):
            events = self.events()
            if not events:
                return
            kind, a = events[self.choose(len(events))]
            self.trace.append(f"{kind} {a.name if a else ''}")
            getattr(self, "_" + kind)(a)
        raise AssertionError("simulation did not finish")

    # events
    def _start(self, a: SimAllocator) -> None:
        count = a.counts.pop(0)
        a.machine = Allocation((Request(count, a.name),), a.name, self.cas_max_attempts, a.floor)
        self._perform(a, a.machine.start())

    def _apply(self, a: SimAllocator) -> None:
        op = a.op
        if op.kind == "read":
            latest = self.zk.latest
            op.result = latest if op.sync else a.seen + self.choose(latest - a.seen + 1)
            self.stats["stale_reads"] += op.result < latest
        else:
            op.result = self.zk.write(op.write.expected_version, op.write.data)
            op.index = self.zk.latest
        op.applied = True

    def _reply(self, a: SimAllocator) -> None:
        op, a.op = a.op, None
        if op.kind == "read":
            a.seen = max(a.seen, op.result)
            try:
                snapshot = self.zk.read(op.result)
            except AtomlogError as error:
                snapshot = error
            resolving = a.machine.state is State.RESOLVING
            action = a.machine.on_read(snapshot, nonce())
            if resolving:
                key = "resolved_ours" if isinstance(action, Done) else "resolved_not_ours"
                self.stats[key] += 1
        elif op.result is None:
            self.stats["conflicts"] += 1
            action = a.machine.on_write_conflict()
        else:
            a.seen = max(a.seen, op.index)
            action = a.machine.on_write_ok(op.result)
        self._perform(a, action)

    def _lose(self, a: SimAllocator) -> None:
        op, a.op = a.op, None
        if op.kind == "read":
            self._perform(a, a.machine.on_unavailable("connection loss"))
        else:
            self._perform(a, a.machine.on_write_uncertain())

    def _drop_request(self, a: SimAllocator) -> None:
        self._lose(a)

    def _delay_request(self, a: SimAllocator) -> None:
        if a.op.kind == "write":
            self.zombies.append(a.op.write)
        self._lose(a)

    def _drop_reply(self, a: SimAllocator) -> None:
        self._lose(a)

    def _expire(self, a: SimAllocator) -> None:
        self._lose(a)  # in-flight requests end with SessionExpired; pending ones may be applied

    def _apply_zombie(self, _a: None) -> None:
        write = self.zombies.pop(self.choose(len(self.zombies)))
        self.stats["zombie_writes_won"] += self.zk.write(write.expected_version, write.data) is not None

    def _perform(self, a: SimAllocator, action) -> None:
        if isinstance(action, Read):
            a.op = Op("read", sync=action.sync)
        elif isinstance(action, Write):
            a.op = Op("write", write=action)
        elif isinstance(action, Done):
            a.issued += [b for b in action.results if isinstance(b, Block)]
            a.floor, a.machine = a.machine.floor, None
        else:
            a.failures.append(action.error.reason)
            a.floor, a.machine = a.machine.floor, None

    # invariants
    def check(self) -> None:
        issued = sorted((b, a.name) for a in self.allocators for b in a.issued)
        for (b1, n1), (b2, n2) in zip(issued, issued[1:]):
            assert b1.last < b2.first, f"overlap: {b1} ({n1}) and {b2} ({n2})"
        for a in self.allocators:
            assert all(x.last < y.first for x, y in zip(a.issued, a.issued[1:])), \
                f"{a.name} issued non-increasing blocks {a.issued}"
            assert set(a.failures) <= {"ZOOKEEPER_UNAVAILABLE", "ID_ALLOCATION_CONFLICT"}, a.failures
            written = [r.last_block for r in self.zk.records() if r.owner == a.name]
            for block in a.issued:  # every block issued was durably written by its owner
                assert any(w.first <= block.first and block.last <= w.last for w in written), block
        lasts = [r.last_block.last for r in self.zk.records()]
        assert lasts == sorted(set(lasts)), "the znode went backwards or repeated"


SEEDS = ([int(os.environ["ATOMLOG_SIM_SEED"])] if "ATOMLOG_SIM_SEED" in os.environ
         else range(400))


@pytest.mark.parametrize("faults", [False, True], ids=["no-faults", "faults"])
def test_seeded_simulation_issues_disjoint_increasing_blocks(faults):
    totals: dict[str, int] = {"issued": 0, "failed": 0}
    for seed in SEEDS:
        rng = random.Random(seed)
        sim = Simulation(rng.randrange, allocators=2 + seed % 3, requests=8, faults=faults)
        try:
            sim.run()
            sim.check()
        except AssertionError as error:
            raise AssertionError(f"seed {seed} (replay: ATOMLOG_SIM_SEED={seed}): {error}\n"
                                 f"last events: {sim.trace[-30:]}") from error
        issued = sum(len(a.issued) for a in sim.allocators)
        totals["issued"] += issued
        totals["failed"] += sum(len(a.failures) for a in sim.allocators)
        for key, value in sim.stats.items():
            totals[key] = totals.get(key, 0) + value
        if not faults:
            assert sum(len(a.failures) for a in sim.allocators) + issued == 8 * len(sim.allocators)
    print(f"simulation faults={faults}: {totals}")
    if len(SEEDS) > 1:  # the faults do not stop progress, and every path was exercised
        assert totals["issued"] > 0.3 * 8 * 3 * len(SEEDS)
        assert totals["conflicts"] > 0 and totals["stale_reads"] > 0
        if faults:
            assert min(totals["resolved_ours"], totals["resolved_not_ours"],
                       totals["zombie_writes_won"]) > 0, totals


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(2, 4), st.booleans())
def test_hypothesis_schedules_issue_disjoint_increasing_blocks(data, allocators, faults):
    sim = Simulation(lambda n: data.draw(st.integers(0, n - 1)), allocators, requests=4,
                     faults=faults, cas_max_attempts=4)
    sim.run(max_steps=600)
    sim.check()


# ------------------------------------------------------------------ client pool core
def test_block_pool_prefetches_at_90_percent_and_keeps_order():
    pool = BlockPool()
    assert pool.take() is None and pool.needs_block()
    pool.add(Block(1, 10))
    taken = [pool.take() for _ in range(8)]
    assert taken == list(range(1, 9)) and not pool.needs_block()
    assert pool.take() == 9 and pool.needs_block()  # 9 of 10 used
    pool.add(Block(501, 510))
    assert not pool.needs_block() and pool.remaining == 11
    assert [pool.take() for _ in range(3)] == [10, 501, 502]
    with pytest.raises(ValueError):
        pool.add(Block(100, 200))  # below what it already holds: refused
    assert BlockPool().needs_block()


# ------------------------------------------------------------------ settings
def test_allocator_settings_defaults_and_inconsistent_limits_refuse():
    from id_allocator.allocator import AllocatorSettings
    from services.config import ConfigError, load_config

    config = load_config("id_allocator", env={})
    settings = AllocatorSettings.from_config(config)
    assert settings == AllocatorSettings.defaults()
    assert settings.default_block_size == 1000 and settings.max_block_size >= 1000
    for overrides, message in (
            ({"id_allocator.default_block_size": 5000, "id_allocator.max_block_size": 100},
             "exceeds id_allocator.max_block_size"),
            ({"id_allocator.cas_backoff_initial_ms": 100, "id_allocator.cas_backoff_max_ms": 10},
             "exceeds id_allocator.cas_backoff_max_ms"),
            ({"id_allocator.default_block_size": 0}, "below the minimum 1"),
            ({"id_allocator.cas_max_attempts": 100_000}, "above the maximum")):
        with pytest.raises(ConfigError, match=message):
            load_config("id_allocator", env={}, overrides=overrides)
