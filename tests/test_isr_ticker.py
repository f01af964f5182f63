"""The ISR checks of every leadership on an event loop ride on one timer, the loop's
IsrTicker (docs/replication.md, "Idle cost"): in process, LeaderReplications without
ZooKeeper (the ISR write is a stand-in that stores what it is given).

- a follower that never fetches leaves the ISR once it has not caught up for max_lag_ms,
  and one whose server left ZooKeeper leaves at the next tick;
- leaderships whose replicas are all in sync and fresh wake no ISR task at all: the
  ticker looks at each once, and not again before a follower could lag; no timer exists
  per partition;
- the ticker stops when the last leadership on its loop ends, and does not keep its
  loop alive;
- a repeat fetch a ReplicateSession skips still records the follower as caught up, so an
  idle partition's followers stay in sync between the session's full looks.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from partition_server.partition_states import Versioned
from atomlog.v1 import common_pb2, partition_pb2
from partition_server.replica import (ISR_CHECK_INTERVAL_S, IsrTicker, LeaderReplication,
                                      ReplicateSession)
from partition_server.replication import PartitionState


def leaderships(tmp_path, count: int, max_lag_ms: int, live, writes: list):
    async def write_isr(known, isr, joining):
        writes.append((time.monotonic(), tuple(isr)))
        return Versioned(PartitionState("a", known.state.leader_epoch, tuple(isr)),
                         known.version + 1)

    known = Versioned(PartitionState("a", 1, ("a", "b")), 0)
    return [LeaderReplication("t", p, "a", known, ["a", "b"], 1, max_lag_ms, 0,
                              tmp_path / f"t-{p}", write_isr, live) for p in range(count)]


def test_a_lagging_follower_and_one_gone_from_zookeeper_leave_the_isr(tmp_path):
    async def scenario():
        writes: list = []
        began = time.monotonic()
        lagging = leaderships(tmp_path, 3, 300, lambda: {"a", "b"}, writes)
        live = {"a", "b"}
        gone = leaderships(tmp_path / "g", 1, 60_000, lambda: set(live), writes)
        for replication in lagging + gone:
            replication.start()
        try:
            deadline = time.monotonic() + 5
            while len(writes) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert [isr for _, isr in writes] == [("a",)] * 3
            assert all(0.3 <= at - began < 0.3 + 4 * ISR_CHECK_INTERVAL_S for at, _ in writes)
            assert [sorted(r.progress.isr) for r in lagging] == [["a"]] * 3
            assert sorted(gone[0].progress.isr) == ["a", "b"]  # fresh: max_lag_ms is 60 s
            live.discard("b")
            left = time.monotonic()
            while len(writes) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert writes[3][1] == ("a",)
            assert writes[3][0] - left < 4 * ISR_CHECK_INTERVAL_S
        finally:
            for replication in lagging + gone:
                await replication.close()

    asyncio.run(scenario())


def test_a_tick_whose_live_servers_cannot_be_read_still_comes_back(tmp_path):
    """The live servers could not be read in one tick (the callable raised). Before, the
    tick ended there without arming the next one: no leader of the loop had its ISR
    checked on time again until a new one registered. Now the leaders are woken to
    check for themselves, and the next tick comes: the lagging follower leaves."""
    async def scenario():
        writes: list = []
        failures = []

        def live():
            if not failures:
                failures.append(1)
                raise RuntimeError("the live servers could not be read (test)")
            return {"a", "b"}

        lagging = leaderships(tmp_path, 1, 300, live, writes)
        lagging[0].start()
        try:
            deadline = time.monotonic() + 5
            while not writes and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert failures and [isr for _, isr in writes] == [("a",)]
        finally:
            await lagging[0].close()

    asyncio.run(scenario())


def test_in_sync_leaderships_wake_no_isr_task_and_share_one_timer(tmp_path):
    async def scenario():
        writes: list = []
        replications = leaderships(tmp_path, 200, 60_000, lambda: {"a", "b"}, writes)
        task_checks, ticker_checks = [0], [0]
        for replication in replications:
            checked = replication._wanted_isr

            def counting(now_ms=None, live=None, checked=checked):
                (task_checks if now_ms is None else ticker_checks)[0] += 1
                return checked(now_ms, live)
            replication._wanted_isr = counting
            replication.start()
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)  # the ISR tasks begin and wait
        ticker = IsrTicker.of(loop)
        timers = len(loop._scheduled)
        try:
            assert len(ticker) == 200
            assert timers <= 2  # the ticker's (and none a partition)
            await asyncio.sleep(5 * ISR_CHECK_INTERVAL_S + 0.1)
            assert task_checks[0] == 0  # no ISR task woke: nothing was due
            # Each looked at once: in sync, it cannot change before a follower could lag
            # (max_lag_ms after its caught-up time) or a server leaves.
            assert ticker_checks[0] == 200
            assert writes == []
        finally:
            for replication in replications:
                await replication.close()
        assert len(ticker) == 0 and ticker._timer is None
        return weakref.ref(loop)

    loop = asyncio.run(scenario())
    gc.collect()
    assert loop() is None  # (its ticker, kept by the loop weakly, does not keep it)


def test_a_skipped_repeat_fetch_keeps_its_follower_caught_up(tmp_path):
    writes: list = []
    replication = leaderships(tmp_path, 1, 1_000, lambda: {"a", "b"}, writes)[0]
    ask = partition_pb2.ReplicateRequest(
        topic_partition=common_pb2.TopicPartition(topic="t", partition=0), replica="b",
        leader_epoch=1, fetch_offset=0, last_fetched_epoch=-1, cursor_sequence=0)
    session = ReplicateSession()
    now = int(time.time() * 1000)  # (the leadership began now: its followers caught up)
    session.found(replication, ask, replication.generation, 0, news=False, now_ms=now)
    follower = replication.progress.followers["b"]
    assert session.skip(replication, ask, now + 400) == 0  # skipped: not looked at in full
    assert follower.caught_up_ms == now + 400
    assert replication.cursors.caught_up_ms["b"] == now + 400
    assert replication._wanted_isr(now + 400 + 900, {"a", "b"}) is None  # in sync still
    assert replication._wanted_isr(now + 400 + 1_001, {"a", "b"}) == {"a"}  # lagging


def test_no_follower_joins_the_isr_while_the_leaders_cursor_store_is_unavailable(tmp_path):
    """A joiner must hold every acknowledged cursor change (`CursorProgress.holds`). While
    the leader's cursor store was reopening after a failure, that check was skipped and
    a follower joined on its log position alone; elected, it lost acknowledged acks (a
    transactional one's consumer then processes its input twice). No joins meanwhile."""
    from types import SimpleNamespace

    async def write_isr(known, isr, joining):
        raise AssertionError("no ISR write expected")

    known = Versioned(PartitionState("a", 1, ("a",)), 0)  # b is out of the ISR
    replication = LeaderReplication("t", 0, "a", known, ["a", "b"], 1, 10_000, 0,
                                    tmp_path / "t-0", write_isr, lambda: {"a", "b"})
    now = int(time.time() * 1000)
    replication._incarnations["b"] = 5
    replication.progress.fetched("b", 0, 0, now)  # b holds the log: it may join
    assert replication._wanted_isr(now, {"a", "b"}) == {"a", "b"}  # (no owner: no cursors)
    replication.owner = SimpleNamespace(subscriptions=SimpleNamespace(store=None))
    assert replication._wanted_isr(now, {"a", "b"}) is None


def test_a_reassignment_whose_state_only_changed_its_isr_meanwhile_is_completed_later(
        tmp_path):
    """A replica that restarts takes itself out of the ISR, which changes the partition
    state's version. The leader's reassignment-completing write then failed its
    compare-and-set, and the leadership was fenced for it (clients got
    NOT_PARTITION_OWNER until the state watch steered this server again). Now it goes on
    with the stored ISR, as an ISR write does, and completes the reassignment later."""
    from partition_server.partition_states import IsrMoved

    calls: list = []

    async def write_isr(known, isr, joining):
        raise AssertionError("no ISR write expected")

    async def complete(known, target, final):
        calls.append((known.version, list(final.isr)))
        if len(calls) == 1:  # c left the ISR meanwhile (version 1)
            raise IsrMoved(Versioned(PartitionState("a", 1, ("a", "b")), 1))
        return Versioned(final, known.version + 1)

    async def scenario():
        known = Versioned(PartitionState("a", 1, ("a", "b", "c")), 0)
        replication = LeaderReplication("t", 0, "a", known, ["a", "b", "c"], 1, 60_000, 0,
                                        tmp_path / "t-0", write_isr, lambda: {"a", "b", "c"},
                                        complete_reassignment=complete)
        replication.start()
        try:
            replication.reassigned(["a", "b", "c"], ["a", "b"])
            for _ in range(200):
                if len(calls) == 2:
                    break
                await asyncio.sleep(0.01)
            assert calls == [(0, ["a", "b"]), (1, ["a", "b"])]
            assert replication.fenced is None and replication.target is None
            assert replication.replicas == ["a", "b"] and replication.known.version == 2
        finally:
            await replication.close()

    asyncio.run(scenario())

