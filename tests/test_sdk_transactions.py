"""The SDK's transaction API against the real cluster (coordinator side: the partition
servers accept transactional data from issue 6 on)."""

from __future__ import annotations

import time

import pytest

from spark_client import Client, errors
from tests.conftest import SHAPES_AND_PATHS, TXN_PATHS


@pytest.fixture(scope="module", params=SHAPES_AND_PATHS, ids="-".join)
def client(request):
    """A client of the multi-process cluster, then of the combined server; each with
    one-call transactions and with the streaming path."""
    shape, path = request.param
    client = Client(request.getfixturevalue(shape).info["bootstrap"],
                    one_call_max_bytes=TXN_PATHS[path])
    try:
        client.create_topic("sdk-txn", partitions=4)
    except errors.TopicAlreadyExists:
        pass
    yield client
    client.close()


def test_commit_is_definite_and_repeatable(client):
    txn = client.begin_transaction(timeout_s=30)
    txn.register_partitions([("sdk-txn", 0), ("sdk-txn", 3), ("sdk-txn", 0)])
    txn.commit(wait_for_markers=True)
    assert txn.state() == "COMMITTED"
    txn.commit()  # again: fine
    with pytest.raises(errors.TransactionNotOpen):
        txn.register_partitions([("sdk-txn", 1)])


def test_context_manager_commits_or_aborts(client):
    with client.transaction(timeout_s=30) as txn:
        txn.register_partitions([("sdk-txn", 1)])
    assert txn.state() in ("COMMITTING", "COMMITTED")
    with pytest.raises(RuntimeError), client.transaction(timeout_s=30) as failed:
        raise RuntimeError("the job failed")
    assert failed.state() in ("ABORTING", "ABORTED")
    failed.abort()  # repeat: fine


def test_unknown_partition_and_timed_out_transaction(client):
    txn = client.begin_transaction(timeout_s=30)
    with pytest.raises(errors.UnknownTopicOrPartition):
        txn.register_partitions([("sdk-txn", 9)])
    txn.abort()
    late = client.begin_transaction(timeout_s=0.3)
    time.sleep(1.2)
    with pytest.raises(errors.TransactionTimedOut) as raised:
        late.commit()
    assert raised.value.abortable  # start a new transaction
    late.abort()  # aborting what the timeout aborted is not an error


def test_transactions_spread_over_tc_partitions(client):
    """Random keys spread over every TC partition there is: 16 on a cluster, 1 on a local
    combined cluster (services.config.COMBINED_TC_PARTITIONS)."""
    count = client.metadata.tc_partition_count
    seen = {client.begin_transaction(timeout_s=5).tc_partition for _ in range(40)}
    assert seen <= set(range(count)) and len(seen) >= min(8, count)


def _describe(txn):
    from atomlog.v1 import coordinator_pb2

    return txn._coordinators.call(
        txn.tc_partition, "DescribeTransaction",
        coordinator_pb2.DescribeTransactionRequest(txn_id=txn.txn_id), time.monotonic() + 10)


def test_begin_is_lazy_and_registers_upfront_targets_in_new_txn(client):
    empty = client.begin_transaction(timeout_s=30)
    assert not empty.opened and empty.state() == "OPEN"
    empty.commit()  # nothing written: nothing to tell the coordinator
    assert not empty.opened and empty.state() == "COMMITTED"
    with pytest.raises(errors.TransactionNotOpen):
        empty.register_partitions([("sdk-txn", 0)])

    # The first registration opens it, with the targets named up front in the same call;
    # a refused up-front target is not the first write's failure.
    txn = client.begin_transaction(timeout_s=30, partitions=[("sdk-txn", 2), ("sdk-txn", 9)],
                                   subscriptions=[("sdk-txn", 3, "sdk-upfront")])
    txn.register_partitions([("sdk-txn", 1)])
    assert txn.opened
    assert txn.registered(("sdk-txn", 2)) and not txn.registered(("sdk-txn", 9))
    described = _describe(txn)
    assert sorted((t.topic, t.partition) for t in described.topic_partitions) == [
        ("sdk-txn", 1), ("sdk-txn", 2)]
    assert [(s.topic, s.partition, s.subscription)
            for s in described.subscription_partitions] == [("sdk-txn", 3, "sdk-upfront")]
    with pytest.raises(errors.UnknownTopicOrPartition):
        txn.register_partitions([("sdk-txn", 9)])
    txn.commit(wait_for_markers=True)
    assert txn.state() == "COMMITTED"

    # The timeout counts from begin_transaction(), also when the first write comes later.
    late = client.begin_transaction(timeout_s=0.3)
    time.sleep(0.5)
    with pytest.raises(errors.TransactionTimedOut):
        late.register_partitions([("sdk-txn", 0)])
    assert late.state() == "ABORTED"


def test_a_held_one_call_turn_keeps_the_next_commit_waiting_until_released_or_due():
    """A one-call commit whose outcome is unknown holds its producers' turn (a retry may
    still stage its records): the producer's next commit waits for its release, or for
    the held-until time, never longer. No cluster: the turns alone."""
    import threading

    from spark_client.transactions import _in_turn

    producer = type("Producer", (), {})()
    first = _in_turn([producer])
    second = _in_turn([producer])
    first.hold(time.monotonic() + 60)
    went = threading.Event()
    waiter = threading.Thread(target=lambda: (second.wait_before(), went.set()))
    waiter.start()
    assert not went.wait(0.7)  # held: the next commit waits
    first.release()
    assert went.wait(5)
    waiter.join(5)
    third = _in_turn([producer])
    fourth = _in_turn([producer])
    third.hold(time.monotonic() + 0.3)  # never released: waits only until then
    began = time.monotonic()
    fourth.wait_before()
    assert 0.2 <= time.monotonic() - began < 5
    assert fourth.before == []  # turns do not chain up in memory


def test_random_idempotency_keys_are_unique_hash_where_asked_and_differ_in_a_forked_child():
    """The SDK's keys: a per-process random prefix and a counter (no kernel random read
    per key); a forked child makes a prefix of its own, else it would repeat its
    parent's keys."""
    import os

    from coordinator.records import tc_partition_for
    from spark_client.transactions import _key_for, _random_key

    keys = [_random_key() for _ in range(1000)]
    assert len(set(keys)) == 1000 and all(k.startswith("sdk-") for k in keys)
    for k in range(16):
        assert tc_partition_for(_key_for(k, 16), 16) == k
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next key, to the parent
        try:
            os.write(write, _random_key().encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    child_key = os.read(read, 200).decode()
    os.close(read)
    parent_key = _random_key()
    prefix = parent_key.rsplit("-", 1)[0]
    assert child_key and not child_key.startswith(prefix + "-")


@pytest.mark.parametrize("threads", [0, -1, 257])
def test_commit_threads_out_of_range_is_refused_before_anything_connects(threads):
    from spark_client import Client

    with pytest.raises(ValueError, match="commit_threads must be 1..256"):
        Client("127.0.0.1:1", commit_threads=threads, tune_allocator=False)
