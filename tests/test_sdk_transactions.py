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


def test_one_call_transactions_gather_on_each_coordinators_lowest_tc_partition(client):
    """A transaction that may commit in one call goes to the lowest TC partition of each
    coordinator in turn (2 coordinators on the cluster: both seen, nothing else); with
    gather_one_calls off, or one-call transactions off, random keys spread over every
    TC partition there is: 16 on a cluster, 1 on a local combined cluster
    (services.config.COMBINED_TC_PARTITIONS). Either way each commits."""
    count = client.metadata.tc_partition_count
    client.metadata.refresh()
    routes = client.metadata.tc_routes
    lowest = {min(k for k, owner in routes.items() if owner == address)
              for address in set(routes.values()) if address}
    gathered = {client.begin_transaction(timeout_s=5).tc_partition for _ in range(40)}
    try:
        client.gather_one_calls = False
        spread = {client.begin_transaction(timeout_s=5).tc_partition for _ in range(40)}
    finally:
        client.gather_one_calls = True
    assert spread <= set(range(count)) and len(spread) >= min(8, count)
    if client.one_call_max_bytes:
        assert gathered == lowest and len(lowest) == (2 if count > 1 else 1)
    else:
        assert len(gathered) >= min(8, count)
    for _ in range(4):  # each coordinator's in turn, and each commits
        with client.transaction(timeout_s=30) as txn:
            txn.register_partitions([("sdk-txn", 2)])
        assert txn.state() in ("COMMITTING", "COMMITTED")


def test_gathering_tc_partitions_are_each_coordinators_lowest_in_order():
    from spark_client.transactions import gathering_tc_partitions

    assert gathering_tc_partitions({}) == []
    assert gathering_tc_partitions({0: "", 1: ""}) == []
    routes = {5: "b:1", 3: "a:1", 9: "a:1", 0: "", 2: "c:1", 7: "b:1", 4: "c:1"}
    assert gathering_tc_partitions(routes) == [2, 3, 5]


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
    # Keys made to hash somewhere and plain ones, interleaved, never meet (a key of
    # _key_for once equalled a later plain one: a NewTxn then found that committed
    # transaction instead of opening its own).
    mixed = [_key_for(i % 16, 16) if i % 2 else _random_key() for i in range(20_000)]
    assert len(set(mixed)) == len(mixed)
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


def test_one_call_turns_of_a_producer_go_in_order_and_release_wakes_their_waiters():
    """A one-call commit's turn (_in_turn, ended by a _TurnEnd, not a Future per
    transaction) waits for the unreleased turn of the same producer before it; a
    released one is not waited for; release wakes its waiters and runs its callbacks
    once; a held turn is over once its time passed."""
    import threading
    from types import SimpleNamespace

    from spark_client.transactions import _in_turn

    producer = SimpleNamespace()
    first, second = _in_turn([producer]), _in_turn([producer])
    assert second.before == [first] and not first.over()
    called = []
    first.done.add_done_callback(called.append)
    waiter = threading.Thread(target=second.wait_before)
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    first.release()
    first.release()
    waiter.join(5)
    assert not waiter.is_alive() and called == [first.done] and first.over()
    second.release()
    assert _in_turn([producer]).before == []  # the last one released: nothing to wait for
    held = _in_turn([SimpleNamespace()])
    held.hold(time.monotonic() - 1)
    assert held.over() and not held.done.done()
    late = []
    first.done.add_done_callback(late.append)  # set already: runs at once
    assert late == [first.done]


@pytest.mark.parametrize("threads", [0, -1, 257])
def test_commit_threads_out_of_range_is_refused_before_anything_connects(threads):
    from spark_client import Client

    with pytest.raises(ValueError, match="commit_threads must be 1..256"):
        Client("127.0.0.1:1", commit_threads=threads, tune_allocator=False)


def _committed_values(client, topic: str) -> list[bytes]:
    from tests.test_one_call import committed_values
    return committed_values(client, topic)


def _topic(client, name: str) -> str:
    try:
        client.create_topic(name, partitions=1)
    except errors.TopicAlreadyExists:
        pass
    return name


def test_a_commit_retried_past_its_time_after_a_lost_answer_settles_it(client, monkeypatch):
    """A one-call commit committed, and its answer was lost (unknown outcome). The caller
    retries commit() once the transaction's time has run out. Before, the retry answered
    a definite TransactionTimedOut without asking: a caller redoing the work wrote the
    record twice. Now it asks (the abort by key answers "already committed"), and
    commit() returns. Without the answer lost, the same retry is a definite timeout and
    nothing is visible."""
    import uuid

    from spark_client import transactions

    if client.one_call_max_bytes == 0:
        pytest.skip("one-call transactions only")
    topic = _topic(client, "sdk-lost-answer")
    ride = transactions._Carpool.ride
    lose = {"after": True, "before": False}

    def ride_losing_the_answer(self, txn, turn, request):
        if lose["before"]:
            lose["before"] = False
            raise errors.error_for("SERVER_UNAVAILABLE", "lost before it went (test)")
        answer = ride(self, txn, turn, request)
        if lose["after"]:
            lose["after"] = False
            raise errors.error_for("SERVER_UNAVAILABLE", "the answer was lost (test)")
        return answer

    monkeypatch.setattr(transactions._Carpool, "ride", ride_losing_the_answer)
    value = uuid.uuid4().bytes
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=3.0)
        sent = [producer.send(topic, value, partition=0, txn=txn) for _ in range(3)]
        with pytest.raises(errors.AtomlogClientError) as unknown:
            txn.commit()
        assert unknown.value.reason == "SERVER_UNAVAILABLE"
        time.sleep(3.3)  # past the transaction's time
        txn.commit()  # settled: it committed
        assert _committed_values(client, topic).count(value) == 3
        # Where they went is not known (before: -1, 0, 1, which read as real offsets).
        assert [future.result(5).offset for future in sent] == [-1, -1, -1]

        lose["before"] = True  # this time the first attempt never reached the server
        other = uuid.uuid4().bytes
        txn = client.begin_transaction(timeout_s=3.0)
        producer.send(topic, other, partition=0, txn=txn)
        with pytest.raises(errors.AtomlogClientError):
            txn.commit()
        time.sleep(3.3)
        with pytest.raises(errors.TransactionTimedOut):
            txn.commit()
        assert other not in _committed_values(client, topic)


def test_abort_while_a_one_call_commit_is_under_way_waits_for_its_outcome(client, monkeypatch):
    """abort() on one thread while commit_async()'s CommitTxn is under way on another.
    Before, abort() found nothing kept and nothing opened, returned at once as if it had
    aborted, and the commit then committed. Now it waits for the commit's outcome and
    raises TransactionAlreadyCommitted, as for a transaction that committed."""
    import threading
    import uuid

    from spark_client import transactions

    if client.one_call_max_bytes == 0:
        pytest.skip("one-call transactions only")
    topic = _topic(client, "sdk-abort-under-way")
    ride = transactions._Carpool.ride
    riding = threading.Event()

    def slow_ride(self, txn, turn, request):
        riding.set()
        time.sleep(0.5)
        return ride(self, txn, turn, request)

    monkeypatch.setattr(transactions._Carpool, "ride", slow_ride)
    value = uuid.uuid4().bytes
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=30)
        producer.send(topic, value, partition=0, txn=txn)
        committing = txn.commit_async()
        assert riding.wait(10)
        with pytest.raises(errors.TransactionAlreadyCommitted):
            txn.abort()
        committing.result(30)
    assert _committed_values(client, topic).count(value) == 1


def test_a_transactional_ack_after_commit_began_is_refused(client, monkeypatch):
    """consumer.ack(..., txn=txn) once txn's commit began (here its outcome is unknown: the
    answer was lost): refused at once, as a send is. Before, the ack was kept and widened
    the retried CommitTxn, which the coordinator answered as already ended without it:
    commit() said committed, and the message was delivered again."""
    from spark_client import transactions

    if client.one_call_max_bytes == 0:
        pytest.skip("one-call transactions only")
    topic = _topic(client, "sdk-late-ack")
    ride = transactions._Carpool.ride
    lost = []

    def ride_losing_the_answer(self, txn, turn, request):
        answer = ride(self, txn, turn, request)
        if not lost:
            lost.append(1)
            raise errors.error_for("SERVER_UNAVAILABLE", "the answer was lost (test)")
        return answer

    with client.producer() as producer:
        producer.send(topic, b"to ack", partition=0).result(30)
        with client.consumer(topic, subscription="late-ack", ack_timeout_s=60) as consumer:
            messages = []
            deadline = time.monotonic() + 30
            while not messages and time.monotonic() < deadline:
                messages = consumer.poll(timeout_s=1, max_records=1)
            monkeypatch.setattr(transactions._Carpool, "ride", ride_losing_the_answer)
            txn = client.begin_transaction(timeout_s=30)
            producer.send(topic, b"output", partition=0, txn=txn)
            with pytest.raises(errors.AtomlogClientError):
                txn.commit()  # unknown
            with pytest.raises(errors.AtomlogClientError) as refused:
                consumer.ack(messages, txn=txn)
            assert refused.value.reason == "TRANSACTION_NOT_OPEN"
            txn.commit()  # the retry: committed, as it was


def test_an_abort_that_cannot_settle_an_unknown_commit_keeps_the_producers_turn_held(
        client, monkeypatch):
    """A one-call commit whose answer was lost holds its producer's turn (a retry may still
    stage its records, and the producer's next commits must not pass them). abort() then
    failed too (its own call lost): before, it had released the turn first. Now the turn
    stays held until the outcome is settled; the next abort() settles it (here: it had
    committed) and releases it."""
    from spark_client import transactions

    if client.one_call_max_bytes == 0:
        pytest.skip("one-call transactions only")
    topic = _topic(client, "sdk-held-turn")
    ride = transactions._Carpool.ride
    call = transactions.Transaction._call
    lose = {"ride": True, "abort": True}

    def ride_losing_the_answer(self, txn, turn, request):
        answer = ride(self, txn, turn, request)
        if lose["ride"]:
            lose["ride"] = False
            raise errors.error_for("SERVER_UNAVAILABLE", "the answer was lost (test)")
        return answer

    def call_failing_the_abort(self, method, request, *args, **kwargs):
        if method == "CommitTxn" and request.abort and lose["abort"]:
            lose["abort"] = False
            raise errors.error_for("SERVER_UNAVAILABLE", "the abort's call failed (test)")
        return call(self, method, request, *args, **kwargs)

    monkeypatch.setattr(transactions._Carpool, "ride", ride_losing_the_answer)
    monkeypatch.setattr(transactions.Transaction, "_call", call_failing_the_abort)
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=30)
        producer.send(topic, b"held", partition=0, txn=txn)
        with pytest.raises(errors.AtomlogClientError):
            txn.commit()  # unknown: the turn is held
        assert not txn._turn.over()
        with pytest.raises(errors.AtomlogClientError) as unsettled:
            txn.abort()
        assert unsettled.value.reason == "SERVER_UNAVAILABLE"
        assert not txn._turn.over()  # still unknown: still held
        with pytest.raises(errors.TransactionAlreadyCommitted):
            txn.abort()  # settled: it had committed
        assert txn._turn.over()


def test_a_retried_commit_waits_again_for_a_held_commit_it_was_carried_with(
        client, monkeypatch):
    """Two one-call commits of one producer, A then B, went in one CommitTxns whose answer
    was lost: both outcomes unknown, both turns held. B's commit() retried must wait for
    A's held turn, as its first attempt did (A's retry may still stage A's records, and
    B's must not pass them). Before, B's turn had forgotten A once its call ended, and the
    retry went at once. Here A's abort settles it (it had committed) and B goes on."""
    import threading
    import uuid

    from spark_client import transactions

    if client.one_call_max_bytes == 0:
        pytest.skip("one-call transactions only")
    topic = _topic(client, "sdk-carried-retry")
    send = transactions._Carpool._send
    carried: list[int] = []

    def send_losing_the_second_answer(self, driver, riders):
        carried.append(len(riders))
        if len(carried) == 1:
            time.sleep(0.5)  # the first commit is slow: the next two queue behind it
        answers = send(self, driver, riders)
        if len(carried) == 2:
            lost = errors.error_for("SERVER_UNAVAILABLE", "the answer was lost (test)")
            return [(None, None, lost)] * (1 + len(riders))
        return answers

    monkeypatch.setattr(transactions._Carpool, "_send", send_losing_the_second_answer)
    values = [uuid.uuid4().bytes for _ in range(3)]
    with client.producer() as producer:
        txns = []
        for value in values:
            txn = client.begin_transaction(timeout_s=30)
            producer.send(topic, value, partition=0, txn=txn)
            txns.append(txn)
        first, a, b = txns
        futures = [txn.commit_async() for txn in txns]
        futures[0].result(30)
        for future in futures[1:]:
            with pytest.raises(errors.AtomlogClientError):
                future.result(30)
        assert carried[:2] == [0, 1]  # A carried B
        retried = threading.Event()
        retry = threading.Thread(target=lambda: (b.commit(), retried.set()))
        retry.start()
        assert not retried.wait(1.0)  # waits for A's held turn
        with pytest.raises(errors.TransactionAlreadyCommitted):
            a.abort()  # settles A (it had committed) and releases its turn
        assert retried.wait(30)
        retry.join(30)
    assert [_committed_values(client, topic).count(v) for v in values] == [1, 1, 1]


class _Keeping:
    """What KeptBy reads of a transaction (a pure core's unit test): `one_call`, and a
    `_switch` that fails as Transaction._switch does when its NewTxn fails (the records
    stay kept)."""

    def __init__(self, fails: bool = False):
        self.one_call = True
        self.fails = fails

    def _switch(self):
        if self.fails:
            raise RuntimeError("NewTxn failed")
        self.one_call = False


def test_kept_by_counts_its_drops_so_a_producer_tells_it_again():
    """A producer's send() skips KeptBy.remember for the transaction it told last while
    KeptBy.drops has not moved (spark_client/producer.py, _kept_last). Every way KeptBy
    forgets transactions moves it: switch_all (also when a switch fails and the
    transaction keeps its records, found by a review: the next flush() would not have
    switched it), and the pruning of a full table."""
    from spark_client.transactions import KeptBy
    kept_by = KeptBy()
    failing = _Keeping(fails=True)
    kept_by.remember(failing)
    assert kept_by.drops == 0 and kept_by.live() == [failing]
    with pytest.raises(RuntimeError):
        kept_by.switch_all()
    assert kept_by.drops == 1 and kept_by.live() == []  # forgotten, though still keeping
    kept_by.remember(failing)  # what send() does once drops moved
    failing.fails = False
    kept_by.switch_all()
    assert not failing.one_call and kept_by.drops == 2
    many = [_Keeping() for _ in range(64)]
    for txn in many:
        kept_by.remember(txn)
    assert kept_by.drops == 2
    many[0].one_call = False
    kept_by.remember(_Keeping())  # the 65th: the table pruned
    assert kept_by.drops == 3 and many[0] not in kept_by.live()
