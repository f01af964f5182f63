"""Partition states in a real ZooKeeper (partition_server/partition_states.py): created all
or nothing, elections by compare-and-set that exactly one of many racing candidates wins,
ISR changes that fail once anything else changed the state."""

from __future__ import annotations

import threading
import uuid

import pytest
from kazoo.client import KazooClient

from partition_server import partition_states as ps, replication
from partition_server.replication import PartitionState
from services.errors import AtomlogError

REPLICAS = [["a", "b", "c"], ["b", "c", "a"]]


@pytest.fixture
def zk(cluster):
    """A kazoo client under a chroot of its own on the test cluster's ZooKeeper."""
    root = KazooClient(hosts=cluster.info["zookeeper"])
    root.start(timeout=10)
    chroot = f"/test-partition-states-{uuid.uuid4().hex[:8]}"
    root.ensure_path(chroot)
    client = KazooClient(hosts=cluster.info["zookeeper"] + chroot)
    client.start(timeout=10)
    try:
        yield client
    finally:
        client.stop()
        client.close()
        root.delete(chroot, recursive=True)
        root.stop()
        root.close()


@pytest.mark.cluster
def test_states_are_created_all_or_nothing(zk):
    ps.create_all(zk, "orders", REPLICAS, live={"b", "c"})
    assert ps.read(zk, "orders", 0).state == PartitionState("b", 0, ("a", "b", "c"))
    assert ps.read(zk, "orders", 1).state == PartitionState("b", 0, ("b", "c", "a"))
    with pytest.raises(AtomlogError) as refused:
        ps.create_all(zk, "orders", REPLICAS, live={"a"})
    assert refused.value.reason == "TOPIC_ALREADY_EXISTS"
    assert ps.read(zk, "orders", 0).state.leader == "b"  # unchanged
    # Leftovers of a topic in the way: nothing of the new one is written.
    zk.create(f"{ps.PARTITIONS_PATH}/other", b"")
    zk.create(f"{ps.PARTITIONS_PATH}/other/0", b"")
    with pytest.raises(AtomlogError):
        ps.create_all(zk, "other", REPLICAS, live={"a"})
    assert zk.get(ps.path_of("other", 0))[0] == b""
    assert not zk.exists(ps.path_of("other", 1))


@pytest.mark.cluster
def test_unreadable_or_missing_states_are_refused_not_guessed(zk):
    with pytest.raises(AtomlogError) as refused:
        ps.read(zk, "nothing", 0)
    assert refused.value.reason == "UNKNOWN_TOPIC_OR_PARTITION"
    zk.create(ps.path_of("bad", 0), b'{"version":1,"leader":"x"}', makepath=True)
    with pytest.raises(AtomlogError) as refused:
        ps.read(zk, "bad", 0)
    assert refused.value.reason == "INTERNAL"
    ps.create_all(zk, "t", REPLICAS, live={"a", "b", "c"})
    with pytest.raises(AtomlogError) as refused:
        ps.read(zk, "t", 0, replicas=["a", "b"])  # the ISR names c
    assert refused.value.reason == "INTERNAL"


@pytest.mark.cluster
def test_exactly_one_of_many_racing_candidates_wins_the_election(zk):
    ps.create_all(zk, "race", REPLICAS, live={"a", "b", "c"})
    live = {"b", "c"}  # a, the leader of partition 0, is gone
    results, start = [], threading.Barrier(8)

    def candidate() -> None:
        start.wait()
        results.append(ps.try_elect(zk, "race", 0, REPLICAS[0], live))

    threads = [threading.Thread(target=candidate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    won = [election for election, _ in results if election is not None]
    assert len(won) == 1
    now = ps.read(zk, "race", 0)
    assert now.state == PartitionState("b", 1, ("b", "c")) == won[0].state
    assert all(state.state == now.state for _, state in results)
    # Nothing more to elect while the new leader lives.
    assert ps.try_elect(zk, "race", 0, REPLICAS[0], live)[0] is None
    assert ps.read(zk, "race", 0).version == now.version


@pytest.mark.cluster
def test_offline_and_back_and_unclean(zk):
    ps.create_all(zk, "t", REPLICAS, live={"a", "b", "c"})
    first = ps.read(zk, "t", 0)
    shrunk = ps.change_isr(zk, "t", 0, first, ["a"])
    assert shrunk.state.isr == ("a",)
    election, offline = ps.try_elect(zk, "t", 0, REPLICAS[0], live={"b", "c"})
    assert offline.state == PartitionState(None, 1, ("a",)) and not election.unclean
    # Only a, the last in-sync replica, may lead again ...
    assert ps.try_elect(zk, "t", 0, REPLICAS[0], live={"b", "c"})[0] is None
    election, back = ps.try_elect(zk, "t", 0, REPLICAS[0], live={"a", "c"})
    assert back.state == PartitionState("a", 2, ("a",))
    # ... unless unclean election is allowed, and then it says so.
    ps.change_isr(zk, "t", 1, ps.read(zk, "t", 1), ["b"])
    election, state = ps.try_elect(zk, "t", 1, REPLICAS[1], live={"c"}, unclean_allowed=True)
    assert election.unclean and state.state == PartitionState("c", 1, ("c",))
    # A partition that went offline before unclean election was allowed (the runbook's
    # "topic alter --set unclean.leader.election.enable=true"): once allowed, a live
    # replica leads. Until 2026-12-06 an offline partition was only elected from its ISR.
    ps.create_all(zk, "u", REPLICAS, live={"a", "b", "c"})
    ps.change_isr(zk, "u", 0, ps.read(zk, "u", 0), ["a"])
    election, offline = ps.try_elect(zk, "u", 0, REPLICAS[0], live={"b", "c"})
    assert offline.state.leader is None and not election.unclean
    assert ps.try_elect(zk, "u", 0, REPLICAS[0], live={"b", "c"})[0] is None
    election, state = ps.try_elect(zk, "u", 0, REPLICAS[0], live={"b", "c"},
                                   unclean_allowed=True)
    assert election.unclean and state.state == PartitionState("b", 2, ("b",))


@pytest.mark.cluster
def test_a_deposed_leaders_isr_change_fails(zk):
    ps.create_all(zk, "t", REPLICAS, live={"a", "b", "c"})
    seen_by_a = ps.read(zk, "t", 0)
    ps.try_elect(zk, "t", 0, REPLICAS[0], live={"b", "c"})  # a paused; b took over
    with pytest.raises(ps.StaleState):
        ps.change_isr(zk, "t", 0, seen_by_a, ["a"])  # a wakes and shrinks the ISR to itself
    assert ps.read(zk, "t", 0).state == PartitionState("b", 1, ("b", "c"))
    with pytest.raises(ValueError):
        ps.change_isr(zk, "t", 0, ps.read(zk, "t", 0), ["c"])  # the leader cannot leave


def test_leaving_the_isr_at_start_is_pure_and_hands_leadership_on():
    state = PartitionState("a", 4, ("a", "b", "c"))
    assert ps.leaving(state, ["a", "b", "c"], "b", {"a", "b", "c"}) == \
        PartitionState("a", 4, ("a", "c"))
    # The leader hands over to the first live in-sync replica, in a new epoch.
    assert ps.leaving(state, ["a", "b", "c"], "a", {"c"}) == PartitionState("c", 5, ("b", "c"))
    # Nothing to do: not in the ISR, or the only live copy of everything acknowledged.
    assert ps.leaving(PartitionState("a", 4, ("a", "c")), ["a", "b", "c"], "b", {"a"}) is None
    assert ps.leaving(state, ["a", "b", "c"], "a", {"a"}) is None
    # Offline: leave the others to lead when back; the last one stays.
    assert ps.leaving(PartitionState(None, 6, ("a", "b")), ["a", "b", "c"], "a", set()) == \
        PartitionState(None, 6, ("b",))
    assert ps.leaving(PartitionState(None, 6, ("a",)), ["a", "b", "c"], "a", set()) is None


def test_an_operator_elects_a_live_replica_of_an_offline_partition_and_nothing_else():
    replicas = ["a", "b", "c"]
    offline = PartitionState(None, 6, ("a",))
    # In the ISR: clean. Outside it: only with accept_data_loss, and then it says so.
    assert replication.elect_chosen(offline, replicas, {"a", "b"}, "a", False) == \
        replication.Election(PartitionState("a", 7, ("a",)), False)
    assert replication.elect_chosen(offline, replicas, {"a", "b"}, "b", True) == \
        replication.Election(PartitionState("b", 7, ("b",)), True)
    assert replication.elect_chosen(PartitionState(None, 6, ()), replicas, {"c"}, "c",
                                    True).state == PartitionState("c", 7, ("c",))
    refusals = [(offline, "b", {"b"}, False, "INVALID_ARGUMENT", "accept_data_loss"),
                (offline, "d", {"d"}, True, "INVALID_ARGUMENT", "not a replica"),
                (offline, "c", {"a"}, True, "INVALID_ARGUMENT", "not a live"),
                (PartitionState("a", 6, ("a", "b")), "b", {"a", "b"}, True,
                 "PARTITION_HAS_LEADER", "has a leader")]
    for state, chosen, live, accept, reason, said in refusals:
        with pytest.raises(AtomlogError) as refused:
            replication.elect_chosen(state, replicas, live, chosen, accept)
        assert refused.value.reason == reason and said in refused.value.message


def test_a_replica_that_lost_its_copy_leaves_the_isr_even_as_its_last_member():
    # Its directory was gone at start: it holds nothing, and leading from it would make
    # the other replicas, which may hold everything, cut their logs to nothing.
    lone = PartitionState(None, 6, ("a",))
    assert ps.leaving(lone, ["a", "b", "c"], "a", set(), copy_lost=True) == \
        PartitionState(None, 6, ())
    # A leader with no live heir gives the leadership up: offline, in a new epoch, the
    # rest of the ISR leads when back (or, none left, an operator chooses).
    assert ps.leaving(PartitionState("a", 4, ("a", "c")), ["a", "b", "c"], "a", {"a"},
                      copy_lost=True) == PartitionState(None, 5, ("c",))
    assert ps.leaving(PartitionState("a", 4, ("a",)), ["a", "b", "c"], "a", {"a", "b"},
                      copy_lost=True) == PartitionState(None, 5, ())
    # Elsewhere it leaves as any restarted replica does.
    state = PartitionState("a", 4, ("a", "b", "c"))
    for me, live in (("b", {"a", "b"}), ("a", {"a", "c"})):
        assert ps.leaving(state, ["a", "b", "c"], me, live, copy_lost=True) == \
            ps.leaving(state, ["a", "b", "c"], me, live)
    assert ps.leaving(PartitionState(None, 6, ("a", "b")), ["a", "b", "c"], "a", set(),
                      copy_lost=True) == PartitionState(None, 6, ("b",))
    # An empty ISR elects nobody cleanly; unclean, the first live replica leads.
    empty = PartitionState(None, 6, ())
    assert replication.elect_offline(empty, ["a", "b", "c"], {"a", "b"}) is None
    assert replication.elect(empty, ["a", "b", "c"], {"b", "c"}) is None
    assert replication.elect(empty, ["a", "b", "c"], {"b", "c"}, unclean_allowed=True) == \
        replication.Election(PartitionState("b", 7, ("b",)), True)


@pytest.mark.cluster
def test_a_restarted_replica_leaves_the_isr_by_compare_and_set(zk):
    ps.create_all(zk, "t", REPLICAS, live=["a", "b", "c"])
    written = ps.leave_isr(zk, "t", 0, REPLICAS[0], "b", ["a", "b", "c"])
    assert written.state == PartitionState("a", 0, ("a", "c"))
    assert ps.leave_isr(zk, "t", 0, REPLICAS[0], "b", ["a", "b", "c"]) is None  # done already
    # A leader's ISR change based on the version before the replica left fails: it rereads.
    with pytest.raises(ps.StaleState):
        ps.change_isr(zk, "t", 0, ps.Versioned(PartitionState("a", 0, ("a", "b", "c")), 0),
                      ["a", "b"])
    moved = ps.leave_isr(zk, "t", 1, REPLICAS[1], "b", ["a", "b", "c"])
    assert moved.state.leader == "c" and moved.state.leader_epoch == 1
    assert "b" not in moved.state.isr


@pytest.mark.cluster
def test_a_reassignment_ends_with_the_record_and_the_state_in_one_transaction(zk):
    import json

    from services.topics import TopicRecord

    ps.create_all(zk, "moving", REPLICAS, live={"a", "b", "c"})
    record = TopicRecord("moving", ["a", "b"], {}, 1, 2, [list(r) for r in REPLICAS])
    zk.create("/topics/moving", json.dumps(record.to_json()).encode(), makepath=True)
    # Both partitions move: partition 1's write lands first and changes the topic record,
    # so partition 0's first attempt must reread it rather than undo partition 1's.
    moving = record.reassigned(0, ["c", "b"]).reassigned(1, ["b", "c"])
    zk.set("/topics/moving", json.dumps(moving.to_json()).encode())
    state1 = ps.read(zk, "moving", 1)
    final1 = PartitionState("b", 0, ("b", "c"))
    assert ps.complete_reassignment(zk, "moving", 1, state1, ["b", "c"], final1).state == final1
    state0 = ps.read(zk, "moving", 0)
    final0 = PartitionState("c", 1, ("c", "b"))
    # A stale state (the version moved on) writes nothing at all.
    with pytest.raises(ps.StaleState):
        ps.complete_reassignment(zk, "moving", 0,
                                 ps.Versioned(state0.state, state0.version - 1 + 100),
                                 ["c", "b"], final0)
    assert TopicRecord.from_json("moving", json.loads(zk.get("/topics/moving")[0])
                                 ).reassigning == {0: ["c", "b"]}
    # Another target replaced this one: nothing written either.
    assert ps.complete_reassignment(zk, "moving", 0, state0, ["a", "b"], final0) is None
    written = ps.complete_reassignment(zk, "moving", 0, state0, ["c", "b"], final0)
    assert written.state == final0 and ps.read(zk, "moving", 0) == written
    stored = TopicRecord.from_json("moving", json.loads(zk.get("/topics/moving")[0]))
    assert stored.replicas == [["c", "b"], ["b", "c"]] and stored.reassigning == {}
    assert stored.assignment == ["c", "b"]


@pytest.mark.cluster
def test_a_replica_joins_the_isr_only_as_its_servers_latest_incarnation(zk):
    """docs/replication.md, "Incarnations": each start of a server writes a newer zxid to
    /incarnations/<name>; an expansion names the incarnation whose fetches it is based on
    and is written in one transaction with a check of that node."""
    ps.create_all(zk, "t", REPLICAS, live={"a", "b", "c"})
    shrunk = ps.change_isr(zk, "t", 0, ps.read(zk, "t", 0), ["a"])
    first = ps.begin_incarnation(zk, "b", {"pid": 1})
    second = ps.begin_incarnation(zk, "b", {"pid": 2})
    assert 0 < first < second
    with pytest.raises(ValueError):  # every replica added names its incarnation
        ps.change_isr(zk, "t", 0, shrunk, ["a", "b"])
    with pytest.raises(ps.StaleIncarnation) as stale:
        ps.change_isr(zk, "t", 0, shrunk, ["a", "b"], {"b": first})
    assert stale.value.current == {"b": second}
    with pytest.raises(ps.StaleIncarnation) as stale:  # c never started
        ps.change_isr(zk, "t", 0, shrunk, ["a", "c"], {"c": 7})
    assert stale.value.current == {"c": 0}
    assert ps.read(zk, "t", 0) == shrunk  # nothing written
    grown = ps.change_isr(zk, "t", 0, shrunk, ["a", "b"], {"b": second})
    assert grown.state.isr == ("a", "b") and ps.read(zk, "t", 0) == grown
    # A shrink names nobody; an expansion against a stale state fails as any write does.
    c = ps.begin_incarnation(zk, "c", {"pid": 3})
    with pytest.raises(ps.StaleState):
        ps.change_isr(zk, "t", 0, shrunk, ["a", "c"], {"c": c})
    assert ps.change_isr(zk, "t", 0, grown, ["a"]).state.isr == ("a",)


@pytest.mark.cluster
def test_an_incarnation_that_begins_between_the_read_and_the_write_stops_the_expansion(
        zk, monkeypatch):
    ps.create_all(zk, "t", REPLICAS, live={"a", "b", "c"})
    shrunk = ps.change_isr(zk, "t", 0, ps.read(zk, "t", 0), ["a"])
    old = ps.begin_incarnation(zk, "b", {"pid": 1})
    read = ps._latest_incarnations
    new = []

    def read_then_restart(client, servers):
        latest = read(client, servers)
        if not new:  # b's next process starts right after the leader read the node
            new.append(ps.begin_incarnation(zk, "b", {"pid": 2}))
        return latest

    monkeypatch.setattr(ps, "_latest_incarnations", read_then_restart)
    with pytest.raises(ps.StaleIncarnation) as stale:
        ps.change_isr(zk, "t", 0, shrunk, ["a", "b"], {"b": old})
    assert stale.value.current == {"b": new[0]}
    assert ps.read(zk, "t", 0) == shrunk
