"""The replication rules (partition_server/replication.py): placement, partition state,
elections, the leader's high watermark and ISR, leader epochs and truncation. Pure: no
servers, no ZooKeeper."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from atomlog.v1 import common_pb2, partition_pb2
from partition_server import replica
from partition_server.replication import (NO_EPOCH, NOT_SYNCED, CopyThrottle, CursorProgress,
                                          LeaderEpochCache, catching_up, LeaderProgress, PartitionState,
                                          assign_replicas, complete_reassignment,
                                          default_replication_factor, elect, elect_offline,
                                          initial_state, reassigning_replicas, resign,
                                          resumes_epoch, truncation_step,
                                          validate_reassignment, validate_replication)
from services.errors import AtomlogError
from services.topics import TopicRecord

SERVERS = ["ps-0", "ps-1", "ps-2", "ps-3", "ps-4"]


# ------------------------------------------------------------------ caught up

def test_a_server_is_caught_up_once_in_every_isr_a_live_leader_serves():
    live = {"ps-0", "ps-1", "ps-2"}
    copies = [
        (("in-sync", 0), PartitionState("ps-1", 3, ("ps-1", "ps-0")), False),
        (("behind", 0), PartitionState("ps-1", 3, ("ps-1", "ps-2")), False),
        (("not-read", 0), None, False),
        # Nothing to copy from: no leader, or one that is not live (it is being replaced).
        (("offline", 0), PartitionState(None, 3, ()), False),
        (("leader-gone", 0), PartitionState("ps-4", 3, ("ps-4",)), False),
        # A reassignment moves its copies at the pace the operator chose.
        (("moving", 0), PartitionState("ps-1", 3, ("ps-1",)), True),
        (("led-here", 1), PartitionState("ps-0", 4, ("ps-0",)), False),
    ]
    assert catching_up("ps-0", copies, live) == [("behind", 0), ("not-read", 0)]
    assert catching_up("ps-0", copies[:1] + copies[3:], live) == []
    assert catching_up("ps-0", [], live) == []


# ------------------------------------------------------------------ placement

def test_default_factor_is_three_or_every_server():
    assert [default_replication_factor(n) for n in (1, 2, 3, 4, 9)] == [1, 2, 3, 3, 3]


@pytest.mark.parametrize("factor,min_insync,servers,reason", [
    (0, 1, 3, "INVALID_REPLICATION_FACTOR"), (8, 1, 9, "INVALID_REPLICATION_FACTOR"),
    (4, 1, 3, "INVALID_REPLICATION_FACTOR"), (3, 0, 3, "INVALID_TOPIC_CONFIG"),
    (3, 4, 3, "INVALID_TOPIC_CONFIG")])
def test_impossible_replication_is_refused(factor, min_insync, servers, reason):
    with pytest.raises(AtomlogError) as refused:
        validate_replication(factor, min_insync, servers)
    assert refused.value.reason == reason


@pytest.mark.parametrize("partitions,servers,factor", [
    (1, 1, 1), (16, 3, 3), (12, 5, 3), (7, 4, 2), (30, 5, 5), (3, 7, 3)])
def test_replicas_are_distinct_leaders_even_and_followers_spread(partitions, servers, factor):
    names = SERVERS[:servers] if servers <= 5 else [f"s{i}" for i in range(servers)]
    placed = assign_replicas(partitions, names, factor)
    assert len(placed) == partitions
    for replicas in placed:
        assert len(replicas) == factor == len(set(replicas))
        assert set(replicas) <= set(names)
    leaders = Counter(r[0] for r in placed)
    assert max(leaders.values()) - min(leaders.get(n, 0) for n in names) <= 1
    everyone = Counter(r for replicas in placed for r in replicas)
    # Every server holds about its share of replicas (within one leader's round).
    assert max(everyone.values()) - min(everyone.get(n, 0) for n in names) <= factor


def test_followers_of_one_leader_do_not_always_land_on_its_neighbour():
    placed = assign_replicas(12, SERVERS[:4], 2)
    followers_of_ps0 = {r[1] for r in placed if r[0] == "ps-0"}
    assert len(followers_of_ps0) == 3


def test_replicas_take_distinct_racks_while_there_are_racks():
    racks = {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "c1": "c", "c2": "c"}
    for replicas in assign_replicas(24, racks, 3, racks):
        assert len({racks[r] for r in replicas}) == 3
    # Two racks, three replicas: both racks used, then the rest.
    two = {"a1": "a", "a2": "a", "a3": "a", "b1": "b"}
    for replicas in assign_replicas(8, two, 3, two):
        assert {two[r] for r in replicas} == {"a", "b"}


def test_placement_leads_with_the_least_loaded_server():
    placed = assign_replicas(2, SERVERS[:3], 2, load={"ps-0": 5, "ps-1": 0, "ps-2": 1})
    assert [r[0] for r in placed] == ["ps-1", "ps-2"]


# ------------------------------------------------------------------ state and elections

def test_state_round_trips_and_refuses_what_cannot_be():
    state = PartitionState("ps-1", 4, ("ps-1", "ps-2"))
    assert PartitionState.from_json(state.to_json(), ["ps-1", "ps-2", "ps-3"]) == state
    with pytest.raises(ValueError):
        PartitionState("ps-1", 0, ("ps-2",))  # leader outside the ISR
    with pytest.raises(ValueError):
        PartitionState("ps-1", -1, ("ps-1",))
    with pytest.raises(ValueError):
        PartitionState("ps-1", 0, ("ps-1", "ps-1"))
    for bad in (b"", b"[]", b'{"version":2,"leader":null,"leader_epoch":0,"isr":[]}',
                b'{"version":1,"leader":"x","leader_epoch":0,"isr":["y"]}',
                b'{"version":1,"leader":null,"leader_epoch":"z","isr":[]}'):
        with pytest.raises(ValueError):
            PartitionState.from_json(bad)
    with pytest.raises(ValueError, match="outside the replicas"):
        PartitionState.from_json(state.to_json(), ["ps-1", "ps-3"])


def test_a_new_partition_is_led_by_its_first_live_replica_with_everyone_in_sync():
    assert initial_state(["b", "a", "c"], {"a", "c"}) == PartitionState("a", 0, ("b", "a", "c"))
    assert initial_state(["b"], set()).leader is None


def test_a_dead_leader_is_replaced_by_the_first_live_in_sync_replica():
    state = PartitionState("a", 3, ("a", "b", "c"))
    assert elect(state, ["a", "b", "c"], {"a", "b", "c"}) is None  # the leader lives
    won = elect(state, ["a", "b", "c"], {"b", "c"})
    assert won.state == PartitionState("b", 4, ("b", "c")) and not won.unclean
    # c is alive but out of sync: it never leads cleanly.
    state = PartitionState("a", 3, ("a", "b"))
    assert elect(state, ["a", "b", "c"], {"b", "c"}).state.leader == "b"
    offline = elect(state, ["a", "b", "c"], {"c"})
    assert offline.state == PartitionState(None, 4, ("b",)) and not offline.unclean
    assert elect(offline.state, ["a", "b", "c"], {"c"}) is None  # stays offline
    # The in-sync replica comes back: it leads, in a new epoch.
    back = elect_offline(offline.state, ["a", "b", "c"], {"b", "c"})
    assert back.state == PartitionState("b", 5, ("b",))
    # The last in-sync replica dies: the ISR remembers it, so only it may lead again.
    alone = PartitionState("a", 7, ("a",))
    assert elect(alone, ["a", "b"], {"b"}).state == PartitionState(None, 8, ("a",))


def test_unclean_election_only_when_allowed_and_it_says_so():
    state = PartitionState("a", 3, ("a",))
    assert elect(state, ["a", "b", "c"], {"c"}).state.leader is None
    won = elect(state, ["a", "b", "c"], {"c"}, unclean_allowed=True)
    assert won.state == PartitionState("c", 4, ("c",)) and won.unclean
    # Clean candidates win over unclean ones even when unclean election is allowed.
    state = PartitionState("a", 3, ("a", "b"))
    assert not elect(state, ["a", "b", "c"], {"b", "c"}, unclean_allowed=True).unclean


# ------------------------------------------------------------------ leader progress

def progress(isr=("a", "b", "c"), min_insync=2, max_lag_ms=10_000, now=0) -> LeaderProgress:
    p = LeaderProgress("a", ["a", "b", "c"], set(isr), min_insync, max_lag_ms, now)
    p.start(leader_end=100, high_watermark=90)
    return p


def test_high_watermark_is_the_smallest_durable_end_over_the_isr():
    p = progress()
    assert p.high_watermark == 90  # what the last leader knew, until followers report
    p.leader_durable(150)
    p.fetched("b", 120, 150, now_ms=1)
    assert p.high_watermark == 90  # c has not reported past it
    p.fetched("c", 110, 150, now_ms=1)
    assert p.high_watermark == 110
    p.fetched("c", 150, 150, now_ms=2)
    assert p.high_watermark == 120
    p.fetched("b", 150, 150, now_ms=2)
    assert p.high_watermark == 150
    # A follower that truncates and fetches lower never moves it back. It lost records
    # acknowledged: it leaves the ISR at once, not after max_lag_ms.
    p.fetched("b", 140, 150, now_ms=3)
    assert p.high_watermark == 150
    assert p.lost == {"b"} and p.shrink(now_ms=3) == {"a", "c"}
    p.isr_changed({"a", "c"})
    assert not p.lost and p.shrink(now_ms=4) is None


def test_followers_outside_the_isr_do_not_hold_the_high_watermark():
    p = progress(isr=("a", "b"))
    p.leader_durable(200)
    p.fetched("b", 200, 200, now_ms=1)
    assert p.high_watermark == 200


def test_fetches_are_checked():
    p = progress()
    with pytest.raises(AtomlogError) as refused:
        p.fetched("z", 10, 100, now_ms=1)
    assert refused.value.reason == "NOT_A_REPLICA"
    with pytest.raises(AtomlogError) as refused:
        p.fetched("b", 101, 100, now_ms=1)
    assert refused.value.reason == "OFFSET_OUT_OF_RANGE"


def test_a_follower_that_stops_catching_up_leaves_the_isr_and_acks_stop_below_min_insync():
    p = progress(max_lag_ms=1_000)
    p.leader_durable(100)
    p.fetched("b", 100, 100, now_ms=500)
    p.fetched("c", 95, 100, now_ms=500)  # behind, but within its time
    assert p.shrink(now_ms=900) is None
    assert p.shrink(now_ms=1_400) == {"a", "b"}  # c: last caught up at start (0)
    p.isr_changed({"a", "b"})
    assert p.may_acknowledge()
    assert p.shrink(now_ms=1_600) == {"a"}
    p.isr_changed({"a"})
    assert not p.may_acknowledge()
    with pytest.raises(ValueError):
        p.isr_changed({"b"})


def test_a_follower_rejoins_once_it_holds_the_high_watermark_and_this_leadership():
    p = progress(isr=("a",), min_insync=1)
    p.leader_durable(300)
    assert p.high_watermark == 300
    p.fetched("b", 250, 300, now_ms=1)
    assert p.expand(leader_epoch_start=100) is None
    p.fetched("b", 300, 300, now_ms=2)
    assert p.expand(leader_epoch_start=100) == {"a", "b"}
    assert p.expand(leader_epoch_start=301) is None  # still before this leader's first write
    p.isr_changed({"a", "b"})
    assert p.lag() == {"b": 0, "c": 300}


def test_a_follower_that_left_the_isr_rejoins_only_on_fetches_made_after_it_left():
    """Chaos seed 2510 (ctp, replication 3): a follower wiped and restarted took itself out
    of the ISR at start; its leader, still holding the position its previous incarnation
    had fetched from, put it straight back. The next election then chose the empty replica
    and every acknowledged record of __txn_log-7 was lost. A follower that leaves the ISR
    now has to show its position again."""
    p = progress(min_insync=2)
    p.leader_durable(290)
    p.fetched("b", 290, 290, now_ms=1)
    p.fetched("c", 290, 290, now_ms=1)
    assert p.high_watermark == 290
    p.isr_changed({"a", "c"})  # b restarted with a wiped disk and left on its own
    assert p.expand(leader_epoch_start=0) is None  # its old position proves nothing now
    assert p.lag()["b"] == 290
    p.fetched("b", 0, 290, now_ms=2)  # the new incarnation, from nothing
    assert p.expand(leader_epoch_start=0) is None
    p.fetched("b", 290, 290, now_ms=3)  # caught up again
    assert p.expand(leader_epoch_start=0) == {"a", "b", "c"}
    cursors = CursorProgress("a", ["a", "b", "c"], 0)
    cursors.leader_durable(7)
    cursors.fetched("b", 7, 1)
    assert cursors.holds("b", {"a", "c"})
    cursors.left_isr({"b"})
    assert cursors.positions["b"] == NOT_SYNCED and not cursors.holds("b", {"a", "c"})
    cursors.fetched("b", 7, 2)
    assert cursors.holds("b", {"a", "c"})
    # Caught up but not in the ISR yet when a new process of its server fetched (or its
    # expansion met a newer incarnation in ZooKeeper): the leader forgets its position too
    # (the new process may hold less).
    q = progress(isr=("a", "c"), min_insync=2)
    q.leader_durable(50)
    q.fetched("c", 50, 50, now_ms=1)
    q.fetched("b", 50, 50, now_ms=1)
    q.forget({"b"})
    assert q.expand(leader_epoch_start=0) is None


def test_a_follower_copying_everything_it_is_sent_stays_caught_up_under_a_steady_stream():
    """Followers copy up to the leader's log end, which moves with every append: a fetch
    never finds it unmoved, so caught up is judged as Kafka does, against the end as of
    the follower's previous fetch."""
    p = progress(max_lag_ms=1_000)
    end = 100
    for now in range(100, 5_000, 100):
        p.fetched("b", end, end + 10, now_ms=now)  # has all it was sent; 10 more arrived
        end += 10
    assert p.followers["b"].caught_up_ms == 4_800  # as of its previous fetch
    assert p.shrink(now_ms=4_950) == {"a", "b"}  # c never fetched: it leaves, b stays
    # A follower that gets less than the leader had (a bounded answer) falls behind.
    p.fetched("b", end - 5, end + 10, now_ms=5_000)
    p.fetched("b", end, end + 20, now_ms=5_100)  # below the end as of its previous fetch
    assert p.followers["b"].caught_up_ms == 4_800


def test_a_leader_gives_its_epoch_up_to_an_in_sync_heir_or_to_itself():
    state = PartitionState("a", 4, ("a", "b", "c"))
    replicas = ["a", "b", "c"]
    assert resign(state, replicas, "a", {"a", "b", "c"}) == PartitionState("b", 5, ("b", "c"))
    assert resign(state, replicas, "a", {"a", "c"}) == PartitionState("c", 5, ("b", "c"))
    assert resign(state, replicas, "a", {"a"}) == PartitionState("a", 5, ("a", "b", "c"))
    alone = PartitionState("a", 4, ("a",))
    assert resign(alone, replicas, "a", {"a", "b", "c"}) == PartitionState("a", 5, ("a",))
    with pytest.raises(ValueError):
        resign(state, replicas, "b", {"a", "b"})
    # A leader whose log is corrupt hands over to an heir or writes nothing.
    assert resign(state, replicas, "a", {"a", "c"}, heir_only=True) == \
        PartitionState("c", 5, ("b", "c"))
    assert resign(state, replicas, "a", {"a"}, heir_only=True) is None
    assert resign(alone, replicas, "a", {"a", "b", "c"}, heir_only=True) is None


def test_a_leadership_resumes_an_epoch_only_if_the_epoch_file_holds_it():
    assert not resumes_epoch(LeaderEpochCache(), 0)
    cache = LeaderEpochCache([(1, 0), (3, 10)])
    assert not resumes_epoch(cache, 4)  # an election: a new epoch
    assert resumes_epoch(cache, 3)  # a restart (or reopen) of the epoch it led
    assert resumes_epoch(cache, 2)


# ------------------------------------------------------------------ leader epochs

def test_epoch_cache_answers_where_each_epoch_ended():
    cache = LeaderEpochCache([(1, 0), (2, 8), (4, 12)])
    assert cache.end_offset_for(0, 20) == (NO_EPOCH, 0)
    assert cache.end_offset_for(1, 20) == (1, 8)
    assert cache.end_offset_for(3, 20) == (2, 12)
    assert cache.end_offset_for(4, 20) == (4, 20)
    assert cache.end_offset_for(9, 20) == (4, 20)
    assert LeaderEpochCache().end_offset_for(3, 0) == (NO_EPOCH, 0)


def test_epoch_cache_keeps_order_and_forgets_empty_epochs():
    cache = LeaderEpochCache([(1, 0)])
    cache.assign(1, 5)  # known: no change
    cache.assign(2, 10)
    cache.assign(3, 10)  # epoch 2 wrote nothing
    assert cache.entries == [(1, 0), (3, 10)]
    with pytest.raises(ValueError):
        cache.assign(2, 20)
    with pytest.raises(ValueError):
        cache.assign(4, 9)
    cache.truncate_from_end(10)
    assert cache.entries == [(1, 0)]
    cache.assign(5, 12)
    cache.truncate_from_start(7)
    assert cache.entries == [(1, 7), (5, 12)]
    cache.truncate_from_start(12)
    assert cache.entries == [(5, 12)]
    assert LeaderEpochCache.decode(cache.encode()).entries == cache.entries
    for bad in (b"", b"2\n0\n", b"1\n2\n1 0\n", b"1\n1\nx y\n", b"1\n2\n3 5\n2 6\n", b"\xff"):
        with pytest.raises(ValueError):
            LeaderEpochCache.decode(bad)


def converge(follower: LeaderEpochCache, follower_end: int, leader: LeaderEpochCache,
             leader_end: int) -> int:
    """The follower's side of the truncation exchange, to its end."""
    ask = follower.latest_epoch()
    end = follower_end
    for _ in range(100):
        if ask == NO_EPOCH:
            end = min(end, leader.entries[0][1] if leader.entries else 0)
            break
        epoch, epoch_end = leader.end_offset_for(ask, leader_end)
        end, ask = truncation_step(follower, end, epoch, epoch_end)
        follower.truncate_from_end(end)
        if ask is None:
            break
    return end


def converge_as_a_follower_does(follower: LeaderEpochCache, follower_end: int,
                                leader: LeaderEpochCache, leader_end: int,
                                leader_start: int = 0) -> int:
    """The exchange as the servers make it: the follower (replica.Follower) asks each
    round about its latest epoch, as its cache stands after the last cut, and the leader
    (replica.Leader._divergence, its log starting at `leader_start`) answers until the
    follower's log is a prefix of its own; an answer of NO_EPOCH, or a fetch below the
    leader's log start, makes the follower start again, empty, at the leader's log start
    (`_restart_at`). Returns where the follower fetches from. Fails if the follower would
    ask for ever."""
    end = follower_end
    for _ in range(100):
        if end < leader_start:  # OFFSET_OUT_OF_RANGE: a restart
            end = leader_start
            follower.entries = []
            continue
        ask = follower.latest_epoch()
        epoch, epoch_end = leader.end_offset_for(ask, leader_end)
        if epoch == ask and end <= epoch_end:
            return end  # no divergence: the follower fetches from `end`
        if epoch == NO_EPOCH:
            end = leader_start
            follower.entries = []
            continue
        end, _ = truncation_step(follower, end, epoch, epoch_end)
        follower.truncate_from_end(end)
    raise AssertionError(f"the follower asks about epoch {follower.latest_epoch()} at "
                         f"{end} for ever")


def test_a_follower_whose_epochs_its_leader_no_longer_keeps_starts_again_at_its_start():
    # The leader began epoch 2 at 1000 and deleted below 1200 (DeleteRecords: the TC
    # log's snapshots do it); the follower's log, all of epoch 1, ends at 1300. The
    # leader answers NO_EPOCH with its log start. Before 2026-12-06 the follower cut to
    # 1200, kept its epoch 1, asked about it again and got the same answer, for ever.
    leader = LeaderEpochCache([(1, 0), (2, 1000)])
    leader.truncate_from_start(1200)
    assert leader.entries == [(2, 1200)]
    follower = LeaderEpochCache([(1, 0)])
    assert converge_as_a_follower_does(follower, 1300, leader, 1500, leader_start=1200) == 1200
    assert follower.entries == []
    # Its log ending below the leader's start: refused OFFSET_OUT_OF_RANGE, it restarts,
    # and asks about no epoch from there.
    follower = LeaderEpochCache([(1, 0)])
    assert converge_as_a_follower_does(follower, 900, leader, 1500, leader_start=1200) == 1200


def test_truncation_finds_where_the_histories_part():
    # The follower wrote 8..9 in epoch 1 under the old leader; the new leader's epoch 2
    # began at 8. One round would keep 8..9 (its epoch 1 ends at 10); the second cuts them.
    leader = LeaderEpochCache([(1, 0), (2, 8), (4, 12)])
    follower = LeaderEpochCache([(1, 0), (3, 10)])
    assert converge(follower, 20, leader, 30) == 8
    # The same as the servers exchange it. Before 2026-12-06 the first round cut only
    # to 12, leaving the follower's epoch 3 (unknown to the leader) its latest, so it
    # asked about epoch 3 again every round and never caught up.
    assert converge_as_a_follower_does(LeaderEpochCache([(1, 0), (3, 10)]), 20, leader,
                                       30) == 8
    # Same epochs, the follower ahead of the leader in the last common one: cut to the leader.
    assert converge(LeaderEpochCache([(1, 0), (2, 5)]), 20,
                    LeaderEpochCache([(1, 0), (2, 5), (3, 15)]), 40) == 15
    # Same epochs, the follower behind: nothing to cut.
    assert converge(LeaderEpochCache([(1, 0), (2, 5)]), 12,
                    LeaderEpochCache([(1, 0), (2, 5), (3, 15)]), 40) == 12
    # The follower's only epoch is newer than anything the leader knows below it.
    assert converge(LeaderEpochCache([(6, 0)]), 9, LeaderEpochCache([(5, 0), (7, 4)]), 10) == 0


def test_truncation_agrees_with_the_logs_themselves_over_random_histories():
    """Simulated leaders and followers: each record is (epoch that wrote it). After the
    exchange, the follower's log is a prefix of the leader's."""
    rng = random.Random(7)
    for _ in range(400):
        shared = [rng.randint(1, 3) for _ in range(rng.randint(0, 6))]
        shared.sort()
        top = shared[-1] if shared else 0
        follower_extra = sorted(rng.randint(top, top + 3) or 1 for _ in range(rng.randint(0, 5)))
        leader_epoch = max([top, *follower_extra]) + rng.randint(0, 2) + 1
        leader_extra = sorted(rng.randint(max(top, 1), leader_epoch)
                              for _ in range(rng.randint(0, 5)))
        # Epochs in the leader's own extra records that the follower also used would mean
        # the same leader wrote different records at one offset: impossible, so skip.
        if set(follower_extra) & set(leader_extra) - ({top} if shared else set()):
            continue
        if shared and follower_extra and leader_extra and follower_extra[0] == top \
                and leader_extra[0] == top:
            continue
        follower_log = shared + follower_extra
        leader_log = shared + leader_extra + [leader_epoch]

        def cache_of(log):
            cache = LeaderEpochCache()
            for offset, epoch in enumerate(log):
                cache.assign(epoch, offset)
            return cache

        for exchange in (converge, converge_as_a_follower_does):
            end = exchange(cache_of(follower_log), len(follower_log), cache_of(leader_log),
                           len(leader_log))
            assert follower_log[:end] == leader_log[:end], (follower_log, leader_log, end)
            # Nothing the two share is cut.
            assert end >= len(shared) or follower_log[:end + 1] != leader_log[:end + 1]
        # The leader deleted its log below a point (retention, DeleteRecords): the
        # follower still converges, and keeps nothing from there that the leader does
        # not hold (below the leader's start it keeps what it has, or starts again).
        start = rng.randint(0, len(leader_log) - 1)
        trimmed = cache_of(leader_log)
        trimmed.truncate_from_start(start)
        follower = cache_of(follower_log)
        end = converge_as_a_follower_does(follower, len(follower_log), trimmed,
                                          len(leader_log), leader_start=start)
        assert start <= end <= len(leader_log)
        if follower.entries or end > start:  # it kept records at or past the start
            assert follower_log[start:end] == leader_log[start:end], (
                follower_log, leader_log, start, end)


# ------------------------------------------------------------------ reassignment

@pytest.mark.parametrize("target,reason_part", [
    ([], "empty"), (["ps-0", "ps-0"], "twice"), (["ps-0", "ps-9"], "not registered"),
    (["ps-0"], "min.insync.replicas"), ([f"ps-{i}" for i in range(8)], "at most"),
])
def test_bad_reassignment_targets_are_refused(target, reason_part):
    with pytest.raises(AtomlogError) as raised:
        validate_reassignment(target, [f"ps-{i}" for i in range(8)], min_insync=2)
    assert raised.value.reason == "INVALID_REPLICA_ASSIGNMENT"
    assert reason_part in raised.value.message


def test_reassignment_keeps_every_copy_until_it_completes():
    assert reassigning_replicas(["a", "b", "c"], ["d", "b"]) == ["d", "b", "a", "c"]
    assert reassigning_replicas(["a", "b"], ["b", "a"]) == ["b", "a"]
    state = PartitionState("a", 4, ("a", "b", "c"))
    # Not every target is in sync yet: nothing ends.
    assert complete_reassignment(state, ["d", "b"], {"a", "b", "c", "d"}) is None
    # The leader stays in the target: same epoch, ISR cut to the target.
    assert complete_reassignment(PartitionState("a", 4, ("a", "b", "d")), ["d", "a"],
                                 {"a", "b", "d"}) == PartitionState("a", 4, ("d", "a"))
    # The leader is left out: the first live target leads in a new epoch.
    assert complete_reassignment(PartitionState("a", 4, ("a", "b", "d")), ["d", "b"],
                                 {"a", "b"}) == PartitionState("b", 5, ("d", "b"))
    assert complete_reassignment(PartitionState("a", 4, ("a", "b", "d")), ["d", "b"],
                                 {"a"}) is None  # no live heir: wait
    assert complete_reassignment(PartitionState(None, 4, ("b", "d")), ["d", "b"],
                                 {"b", "d"}) is None  # offline: an election comes first


def test_topic_record_reassignment_round_trips():
    record = TopicRecord("t", ["a", "b"], {}, 1, 2, [["a", "b"], ["b", "c"]])
    assert record.reassigned(0, ["a", "b"]) is None
    moving = record.reassigned(0, ["c", "b"])
    assert moving.replicas == [["c", "b", "a"], ["b", "c"]] and moving.assignment == ["c", "b"]
    assert moving.reassigning == {0: ["c", "b"]} and moving.replication_factor == 2
    assert TopicRecord.from_json("t", moving.to_json()) == moving
    replaced = moving.reassigned(0, ["a", "c"])  # a new target keeps every current copy
    assert replaced.replicas[0] == ["a", "c", "b"] and replaced.reassigning == {0: ["a", "c"]}
    done = moving.reassignment_done(0)
    assert done.replicas == [["c", "b"], ["b", "c"]] and done.reassigning == {}
    assert "reassigning" not in done.to_json()
    for bad in ({"0": ["z"]}, {"5": ["a"]}, {"x": ["a"]}, {"0": []}):
        with pytest.raises(ValueError):
            TopicRecord.from_json("t", {**moving.to_json(), "reassigning": bad})
    # A throttle rides with its reassignment: replaced with it, gone when it ends.
    throttled = record.reassigned(0, ["c", "b"], 5_000_000)
    assert throttled.throttle_of(0) == 5_000_000 and throttled.throttle_of(1) == 0
    assert TopicRecord.from_json("t", throttled.to_json()) == throttled
    assert throttled.reassigned(0, ["c", "b"]).throttle_of(0) == 0  # lifted
    assert throttled.reassigned(0, ["c", "b"], 7).throttle_of(0) == 7
    assert throttled.reassignment_done(0).throttles == {}
    assert "reassign_throttle" not in throttled.reassignment_done(0).to_json()
    for bad in ({"0": 0}, {"0": -5}, {"x": 5}, {"0": "5"}):
        with pytest.raises(ValueError):
            TopicRecord.from_json("t", {**throttled.to_json(), "reassign_throttle": bad})


def test_copy_throttle_is_a_token_bucket_per_replica():
    throttle = CopyThrottle(1000)  # bytes/s, a burst of one second's worth
    assert throttle.allowance("c", 10.0) == 1000 and throttle.wait_s("c", 10.0) == 0
    throttle.spent("c", 1500, 10.0)  # a whole first batch may overdraw
    assert throttle.allowance("c", 10.0) == -500
    assert throttle.wait_s("c", 10.0) == pytest.approx(0.501)
    assert throttle.allowance("c", 10.6) == pytest.approx(100, abs=1)
    assert throttle.allowance("c", 20.0) == 1000  # never more than the burst
    assert throttle.allowance("d", 10.0) == 1000  # each replica its own bucket
    with pytest.raises(ValueError):
        CopyThrottle(0)


def test_leader_progress_takes_new_replicas_and_forgets_those_that_left():
    progress = LeaderProgress("a", ["a", "b"], {"a", "b"}, 2, 10_000, 0)
    progress.start(100, 100)
    progress.fetched("b", 100, 100, 1)
    progress.replicas_changed(["c", "b", "a"], 5)
    assert progress.lag()["c"] == 100 and progress.high_watermark == 100
    assert progress.expand(0) is None  # c holds nothing yet
    progress.fetched("c", 100, 100, 6)
    assert progress.expand(0) == {"a", "b", "c"}
    progress.isr_changed({"a", "c"})
    progress.replicas_changed(["a", "c"], 7)
    assert set(progress.followers) == {"c"}
    cursors = CursorProgress("a", ["a", "b"], 0)
    cursors.replicas_changed(["a", "b", "c"], {"a", "b"}, 3)
    assert cursors.positions["c"] == NOT_SYNCED
    cursors.replicas_changed(["a", "c"], {"a", "c"}, 4)
    assert set(cursors.positions) == {"c"}


# ------------------------------------------------------------------ quiet partitions

class _Leader:
    """What ReplicateSession reads of a LeaderReplication (a pure core's stand-in)."""

    def __init__(self, max_lag_ms: int = 10_000, topic: str = "t", partition: int = 0):
        self.topic, self.partition = topic, partition
        self.generation = 0
        self.watchers: set = set()
        self.throttle = None
        self.progress = type("Progress", (), {"max_lag_ms": max_lag_ms})()
        self.repeats: list[tuple] = []

    def fetched_again(self, replica, fetch, cursor_sequence, now_ms):
        self.repeats.append((replica, fetch, cursor_sequence, now_ms))
        return 42

    _moved = replica.LeaderReplication._moved  # (the real one: the generation, the stirs)


def _ask(topic="t", partition=0, fetch=5, epoch=1, cursor=-1, leader_epoch=2, incarnation=7):
    return partition_pb2.ReplicateRequest(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition),
        fetch_offset=fetch, last_fetched_epoch=epoch, cursor_sequence=cursor,
        leader_epoch=leader_epoch, replica_incarnation=incarnation)


def test_a_session_skips_a_partition_only_while_nothing_it_depends_on_moved():
    session, leader = replica.ReplicateSession(), _Leader()
    assert session.skip(leader, _ask(), 1_000) is None  # never looked at
    session.found(leader, _ask(), leader.generation, 42, news=False, now_ms=1_000)
    assert session.skip(leader, _ask(), 1_000 + replica.SESSION_RECHECK_MS - 1) == 42
    # A skipped repeat is recorded (what keeps the follower's caught-up time fresh), at
    # most every SESSION_RECORD_MS:
    assert leader.repeats == [("", 5, -1, 1_000 + replica.SESSION_RECHECK_MS - 1)]
    assert session.skip(leader, _ask(), 1_000 + replica.SESSION_RECHECK_MS - 1) == 42
    assert len(leader.repeats) == 1
    # Each of these makes the call look at it again (begin_replicate, has_news):
    assert session.skip(leader, _ask(), 1_000 + replica.SESSION_RECHECK_MS) is None  # time to
    assert session.skip(_Leader(), _ask(), 1_001) is None  # another leadership
    for changed in (dict(fetch=6), dict(epoch=2), dict(cursor=3), dict(leader_epoch=3),
                    dict(incarnation=8)):
        assert session.skip(leader, _ask(**changed), 1_001) is None, changed
    assert session.skip(leader, _ask(partition=1), 1_001) is None  # another partition
    leader.throttle = object()  # a throttled reassignment refills with time
    assert session.skip(leader, _ask(), 1_001) is None
    leader.throttle = None
    leader.generation += 1  # an append, a flush, the cursors, the log start, the replicas
    assert session.skip(leader, _ask(), 1_001) is None
    # Recorded as of the generation seen before the look: a wake during it counts.
    session.found(leader, _ask(), leader.generation - 1, 42, news=False, now_ms=1_001)
    assert session.skip(leader, _ask(), 1_002) is None
    session.found(leader, _ask(), leader.generation, 42, news=False, now_ms=1_001)
    assert session.skip(leader, _ask(), 1_002) == 42
    session.found(leader, _ask(), leader.generation, 42, news=True, now_ms=1_002)
    assert session.skip(leader, _ask(), 1_002) is None  # news: looked at until quiet again


def test_a_session_rechecks_within_half_of_max_lag_and_stays_bounded():
    session, leader = replica.ReplicateSession(), _Leader(max_lag_ms=200)
    session.found(leader, _ask(), 0, 1, news=False, now_ms=0)
    assert session.skip(leader, _ask(), 99) == 1  # (its repeat recorded by the full look)
    assert session.skip(leader, _ask(), 100) is None
    for partition in range(replica.SESSION_MAX_PARTITIONS + 1):
        session.found(leader, _ask(partition=partition), 0, 1, news=False, now_ms=0)
    assert len(session.quiet) <= replica.SESSION_MAX_PARTITIONS


def _key(partition: int) -> tuple[str, int]:
    return ("t", partition)


def test_a_fetch_session_looks_only_at_named_active_and_stirred_partitions():
    """The wire's fetch session (docs/replication.md, "Fetch sessions"): a call looks at
    what it names, what was not quiet after the last call, and quiet partitions whose
    leader moved since (told through its watchers); the quiet rest costs nothing per call
    but a sweep every SESSION_RECORD_MS, which records their repeats and brings back those
    whose full look is due."""
    session = replica.ReplicateSession()
    leaders = [_Leader(topic="t", partition=p) for p in range(4)]
    session_id = session.open({_key(p): _ask(partition=p) for p in range(4)}, now_ms=1_000)
    assert session_id and session.epoch == 1
    # The opening call looked at all four: 1 had news, the others were quiet.
    for p in (0, 2, 3):
        session.found(leaders[p], _ask(partition=p), 0, 7, news=False, now_ms=1_000)
    session.settle([_key(p) for p in range(4)], [_key(1)])
    assert session.active == {_key(1)}
    assert all(session in leaders[p].watchers for p in (0, 2, 3))
    # The next call names nothing: only the active one is looked at (no sweep yet).
    session.advance(session_id, 2, {}, [])
    assert sorted(session.working({}, now_ms=1_000)) == [_key(1)]
    assert not any(leader.repeats for leader in leaders)
    session.found(leaders[1], _ask(partition=1), 0, 7, news=False, now_ms=1_000)
    session.settle([_key(1)], [])  # 1 was quiet this time: nothing is active now
    assert session.active == set()
    # A write to 2 stirs it (and wakes a waiting call); a named one is looked at too.
    waiting = None

    async def stir():
        nonlocal waiting
        waiting = session.stir_future()
        leaders[2]._moved()
        await asyncio.sleep(0)

    asyncio.run(stir())
    assert waiting.done() and not leaders[2].watchers
    session.advance(session_id, 3, {_key(3): _ask(partition=3, fetch=6)}, [])
    assert sorted(session.working({_key(3): None}, now_ms=1_100)) == [_key(2), _key(3)]
    assert session.asked[_key(3)].fetch_offset == 6
    for p in (2, 3):  # both quiet again once looked at
        session.found(leaders[p], session.asked[_key(p)], leaders[p].generation, 7,
                      news=False, now_ms=1_000)
    session.settle([_key(2), _key(3)], [])
    assert session.active == set() and session in leaders[2].watchers
    # The sweep: past SESSION_RECORD_MS the quiet rest have their repeat recorded, and
    # past the recheck one is looked at in full.
    session.advance(session_id, 4, {}, [])
    assert session.working({}, now_ms=1_000 + replica.SESSION_RECORD_MS) == []
    assert leaders[0].repeats == [("", 5, -1, 1_000 + replica.SESSION_RECORD_MS)]
    assert leaders[3].repeats == [("", 6, -1, 1_000 + replica.SESSION_RECORD_MS)]
    session.advance(session_id, 5, {}, [])
    late = 1_000 + replica.SESSION_RECHECK_MS
    assert sorted(session.working({}, now_ms=late)) == [_key(p) for p in range(4)]


def test_a_fetch_session_refuses_another_session_or_epoch_and_checks_before_applying():
    session = replica.ReplicateSession()
    with pytest.raises(AtomlogError) as refused:
        session.advance(1, 2, {}, [])  # none open
    assert refused.value.reason == "REPLICATE_SESSION_INVALID"
    session_id = session.open({_key(0): _ask(partition=0), _key(1): _ask(partition=1)})
    # Forgetting what it does not hold, or what the call names too, or growing past the
    # bound: refused, nothing applied (the epoch is still the next one).
    for named, forgotten in (({}, [_key(5)]), ({_key(0): _ask()}, [_key(0)]),
                             ({_key(p): _ask(partition=p) for p in
                               range(2, replica.REPLICATE_MANY_MAX_PARTITIONS + 1)}, [])):
        with pytest.raises(AtomlogError) as refused:
            session.advance(session_id, 2, named, forgotten)
        assert refused.value.reason == "INVALID_ARGUMENT"
        assert set(session.asked) == {_key(0), _key(1)} and session.epoch == 1
    leader = _Leader(topic="t", partition=1)
    session.found(leader, _ask(partition=1), 0, 7, news=False, now_ms=0)
    session.advance(session_id, 2, {}, [_key(1)])
    assert set(session.asked) == {_key(0)} and _key(1) not in session.quiet
    # A skipped or repeated epoch, or another id, is refused and closes the session.
    for wrong_id, wrong_epoch in ((session_id, 4), (session_id + 1, 3), (session_id, 2)):
        with pytest.raises(AtomlogError) as refused:
            session.advance(wrong_id, wrong_epoch, {}, [])
        assert refused.value.reason == "REPLICATE_SESSION_INVALID"
    with pytest.raises(AtomlogError):
        session.advance(session_id, 3, {}, [])  # (closed by the first refusal)
    assert session.open({_key(0): _ask()}) != session_id


def test_a_fetcher_a_follower_holds_is_not_dropped_before_the_follower_adds_itself():
    """A follower gets its leader's fetcher when it is made and adds itself once its start
    (opening its log) is done; meanwhile the fetcher is idle. Making another leader's
    fetcher then dropped it, and the leader's next follower got a second fetcher: two
    fetchers to one leader, each closing the other's fetch session at every call."""
    from types import SimpleNamespace

    from partition_server.manager import PartitionManager, ReplicationSettings

    manager = PartitionManager.__new__(PartitionManager)  # (only what _fetcher uses)
    manager.fetchers, manager.followers = {}, {}
    manager.server_name, manager._stubs = "b", None
    manager.replication = ReplicationSettings()
    first = manager._fetcher("a", "127.0.0.1:1")
    assert first.idle
    manager.followers[("t", 0)] = SimpleNamespace(fetcher=first)  # starting: not added yet
    manager._fetcher("c", "127.0.0.1:3")
    assert manager._fetcher("a", "127.0.0.1:1") is first
    del manager.followers[("t", 0)]  # (its start failed: nothing holds it)
    manager._fetcher("d", "127.0.0.1:4")
    assert manager._fetcher("a", "127.0.0.1:1") is not first


def test_a_stir_before_a_call_waits_wakes_the_wait_at_once():
    """A partition stirred while no call of the session waited (between calls, or while a
    call was still routing) wakes the next wait at once, not at the next stir."""
    session, leader = replica.ReplicateSession(), _Leader(topic="t", partition=0)
    session.open({_key(0): _ask()}, now_ms=0)
    session.found(leader, _ask(), 0, 7, news=False, now_ms=0)

    async def scenario():
        assert not session.stir_future().done()
        leader._moved()  # wakes the waiter made above
        assert session.stir_future().done()  # (still stirred: not taken yet)
        assert session.take_stirred() == [_key(0)]
        assert not session.stir_future().done()

    asyncio.run(scenario())
