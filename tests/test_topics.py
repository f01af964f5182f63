"""Topic rules (pure): names, config, and the even assignment of partitions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.errors import AtomlogError
from services.topics import (TopicRecord, altered_config, assign_partitions, validate_partition_count, validate_topic_config,
                             validate_topic_name)


@pytest.mark.parametrize("name", ["orders", "a", "A.b-c_d", "x" * 249])
def test_good_names(name):
    validate_topic_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "x" * 250, "with space", "slash/y", "ü",
                                  "__internal"])
def test_bad_names(name):
    with pytest.raises(AtomlogError) as raised:
        validate_topic_name(name)
    assert raised.value.reason == "INVALID_TOPIC_NAME"


def test_internal_names_allowed_only_internally():
    validate_topic_name("__txn_log-3", internal_allowed=True)


def test_partition_count_bounds():
    validate_partition_count(1, 10)
    validate_partition_count(10, 10)
    for bad in (0, -1, 11):
        with pytest.raises(AtomlogError, match="between 1 and 10"):
            validate_partition_count(bad, 10)


def test_topic_config_validation():
    assert validate_topic_config({"retention.ms": "-1", "cleanup.policy": "delete"}) == {
        "retention.ms": "-1", "cleanup.policy": "delete"}
    # Keyed compaction is not implemented: refused with why, not accepted and ignored.
    with pytest.raises(AtomlogError, match="keyed compaction is not implemented") as raised:
        validate_topic_config({"cleanup.policy": "compact"})
    assert raised.value.reason == "INVALID_TOPIC_CONFIG"
    for bad in ({"retention.ms": "5"}, {"cleanup.policy": "keep"}, {"segment.bytes": "x"},
                {"what": "1"}):
        with pytest.raises(AtomlogError) as raised:
            validate_topic_config(bad)
        assert raised.value.reason == "INVALID_TOPIC_CONFIG"


ONE_COPY = TopicRecord("one", ["ps-0", "ps-1"], {"retention.ms": "60000"}, 1000)
THREE_COPIES = TopicRecord("three", ["ps-0", "ps-1"], {"min.insync.replicas": "2"}, 1000, 2,
                           [["ps-0", "ps-1", "ps-2"], ["ps-1", "ps-2", "ps-0"]])


TXN_LOG = TopicRecord("__txn_log", ["ps-0"], {"retention.ms": "-1", "retention.bytes": "-1"},
                      1000, 2, [["ps-0", "ps-1", "ps-2"]])


def test_altering_a_topic_sets_replaces_and_deletes_normalized():
    assert altered_config(ONE_COPY, {"retention.bytes": "-1", "segment.ms": "01000"}, []) == {
        "retention.ms": "60000", "retention.bytes": "-1", "segment.ms": "1000"}
    assert altered_config(ONE_COPY, {"retention.ms": "120000"}, []) == {"retention.ms": "120000"}
    assert altered_config(ONE_COPY, {}, ["retention.ms", "segment.ms"]) == {}
    assert altered_config(THREE_COPIES, {"min.insync.replicas": "3",
                                         "unclean.leader.election.enable": "true"}, []) == {
        "min.insync.replicas": "3", "unclean.leader.election.enable": "true"}
    assert ONE_COPY.config == {"retention.ms": "60000"}  # the record itself is untouched
    assert altered_config(TXN_LOG, {"unclean.leader.election.enable": "true"}, []) == {
        "retention.ms": "-1", "retention.bytes": "-1", "unclean.leader.election.enable": "true"}


@pytest.mark.parametrize("record, to_set, to_delete, words", [
    (ONE_COPY, {"no.such": "1"}, [], "unknown topic setting"),
    (ONE_COPY, {}, ["no.such"], "unknown topic setting"),
    (ONE_COPY, {"retention.ms": "soon"}, [], "not an integer"),
    (ONE_COPY, {"retention.ms": "5"}, [], "outside"),
    (ONE_COPY, {"retention.ms": "60000"}, ["retention.ms"], "both set and deleted"),
    (ONE_COPY, {"min.insync.replicas": "1"}, [], "without replication state"),
    (ONE_COPY, {"unclean.leader.election.enable": "true"}, [], "without replication state"),
    (THREE_COPIES, {"min.insync.replicas": "4"}, [], "must be 1..3"),
    (THREE_COPIES, {"unclean.leader.election.enable": "yes"}, [], "not one of"),
    (TXN_LOG, {"retention.ms": "60000"}, [], "are the cluster's"),
    (TXN_LOG, {}, ["retention.bytes"], "are the cluster's"),
])
def test_altering_a_topic_refuses_bad_changes(record, to_set, to_delete, words):
    with pytest.raises(AtomlogError) as raised:
        altered_config(record, to_set, to_delete)
    assert raised.value.reason == "INVALID_TOPIC_CONFIG" and words in raised.value.message


def test_min_insync_counts_the_fewest_copies_a_running_reassignment_leaves():
    moving = TopicRecord("moving", ["ps-0", "ps-1"], {}, 1000, 2,
                         [["ps-0", "ps-1", "ps-2"], ["ps-1", "ps-2", "ps-0"]],
                         reassigning={1: ["ps-1", "ps-2"]})
    assert altered_config(moving, {"min.insync.replicas": "2"}, []) == {
        "min.insync.replicas": "2"}
    with pytest.raises(AtomlogError, match="must be 1..2"):
        altered_config(moving, {"min.insync.replicas": "3"}, [])


def test_deleting_min_insync_is_checked_against_the_default_it_falls_back_to():
    """A partition reassigned to one copy under min.insync.replicas=1: deleting the
    setting brought back the default, 2, unchecked, and every write to that partition was
    refused (NOT_ENOUGH_REPLICAS) from then on."""
    shrunk = TopicRecord("shrunk", ["ps-0", "ps-1"], {"min.insync.replicas": "1"}, 1000, 2,
                         [["ps-0", "ps-1", "ps-2"], ["ps-1"]])
    with pytest.raises(AtomlogError, match=r"min.insync.replicas=2 \(the default\) must be 1..1"):
        altered_config(shrunk, {}, ["min.insync.replicas"])
    assert altered_config(shrunk, {"retention.ms": "60000"}, []) == {
        "min.insync.replicas": "1", "retention.ms": "60000"}


def test_no_servers_is_retriable():
    with pytest.raises(AtomlogError) as raised:
        assign_partitions(3, [])
    assert raised.value.reason == "NO_PARTITION_SERVERS" and raised.value.retriable


@given(partitions=st.integers(1, 300),
       servers=st.lists(st.sampled_from([f"ps-{i}" for i in range(12)]), min_size=1, unique=True),
       load=st.dictionaries(st.sampled_from([f"ps-{i}" for i in range(12)]), st.integers(0, 50)))
def test_assignment_is_even_and_favours_the_least_loaded(partitions, servers, load):
    owners = assign_partitions(partitions, servers, load)
    assert len(owners) == partitions and set(owners) <= set(servers)
    counts = [owners.count(s) for s in servers]
    assert max(counts) - min(counts) <= 1
    if len(servers) > 1 and partitions >= len(servers):
        assert all(owners[i] != owners[i + 1] for i in range(len(owners) - 1))
    # A server with more partitions than another here was not more loaded before.
    for a in servers:
        for b in servers:
            if owners.count(a) > owners.count(b):
                assert (load.get(a, 0), a) <= (load.get(b, 0), b)


def test_a_topic_created_compact_before_it_was_refused_is_told_to_drop_it():
    """Topics created with cleanup.policy=compact while it was accepted (and ignored) keep
    their record; any change to them names the setting until it goes or becomes delete."""
    legacy = TopicRecord("legacy", ["ps-0"], {"cleanup.policy": "compact"}, 1000)
    with pytest.raises(AtomlogError, match="cleanup.policy='compact' is not supported"):
        altered_config(legacy, {"retention.ms": "-1"}, [])
    assert altered_config(legacy, {"retention.ms": "-1"}, ["cleanup.policy"]) == {
        "retention.ms": "-1"}
    assert altered_config(legacy, {"cleanup.policy": "delete"}, []) == {
        "cleanup.policy": "delete"}


def test_topics_past_the_limit_are_refused_and_internal_ones_do_not_count():
    """Topic names are user input, and each topic costs ZooKeeper znodes and every server
    hosting it metric series that are never removed: nothing bounded their number.
    topics.max_topics does now (the store's check, before anything is written)."""
    import asyncio
    from types import SimpleNamespace

    from services.metadata import MetadataStore
    from services.topics import TopicRecord

    class Store(MetadataStore):
        written: list[str] = []

        async def servers(self):
            return [SimpleNamespace(name="ps-0", role="partition_server", rack="")]

        async def topics(self):
            return [TopicRecord("__txn_log", ["ps-0"]), TopicRecord("a", ["ps-0"]),
                    TopicRecord("b", ["ps-0"])]

    store = Store(zk=None, tc_partitions=1, max_partitions=10, default_replication_factor=1,
                  max_topics=2)
    with pytest.raises(AtomlogError) as refused:
        asyncio.run(store.create_topic("c", 1, {}))
    assert refused.value.reason == "RESOURCE_EXHAUSTED"
    assert refused.value.metadata["limit"] == "topics.max_topics"
    store.max_topics = 3  # __txn_log is not counted: "c" would be the third
    with pytest.raises(AttributeError):  # past the check: it reached ZooKeeper (None here)
        asyncio.run(store.create_topic("c", 1, {}))
