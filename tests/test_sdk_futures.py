"""The SDK's record futures (spark_client.producer._Outcome, RecordFuture): a pure core,
no server."""

from __future__ import annotations

import sys
import threading

import pytest

from spark_client.producer import RecordFuture, _Outcome


def test_a_record_outcome_runs_each_callback_once_and_wakes_its_waiters():
    """A callback added before the outcome settles runs at the settling, one added after
    runs at once; a waiter wakes when it settles, and one that waits too long gets
    TimeoutError."""
    outcome = _Outcome("t", 3)
    future = RecordFuture(outcome, 2)
    seen = []
    future.add_done_callback(lambda f: seen.append(("before", f.result().offset)))
    assert not future.done()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    waiter = threading.Thread(target=lambda: seen.append(("waited", future.result(5).offset)))
    waiter.start()
    outcome.settle(10, 7, None)
    waiter.join(5)
    future.add_done_callback(lambda f: seen.append(("after", f.result().offset)))
    assert sorted(seen) == [("after", 12), ("before", 12), ("waited", 12)]
    assert future.done() and future.exception() is None


def test_a_failed_outcome_raises_its_error_for_every_record():
    outcome = _Outcome("t", 0)
    outcome.settle(-1, -1, ValueError("refused"))
    for index in range(3):
        with pytest.raises(ValueError, match="refused"):
            RecordFuture(outcome, index).result(0)


def test_callbacks_added_from_many_threads_as_it_settles_each_run_once():
    """8 threads add callbacks while the outcome settles, switching threads at nearly
    every bytecode: none is lost or run twice."""
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave at nearly every bytecode
    try:
        _race_callbacks_against_settling()
    finally:
        sys.setswitchinterval(switching)


def _race_callbacks_against_settling():
    for _ in range(200):
        outcome, calls, go = _Outcome("t", 0), [], threading.Barrier(9)

        def add():
            go.wait()
            for _ in range(20):
                RecordFuture(outcome, 0).add_done_callback(lambda f: calls.append(1))

        threads = [threading.Thread(target=add) for _ in range(8)]
        for thread in threads:
            thread.start()
        go.wait()
        outcome.settle(0, 0, None)
        for thread in threads:
            thread.join()
        assert len(calls) == 160


def test_read_until_counts_progress_not_rows():
    """read_until's idle timeout counted rows only: a long run of aborted data (or
    markers) under read_committed moves the positions with nothing to hand out, and the
    read of it failed as "not readable" although it advanced all along (a Spark task over
    such a range failed, and with it the job)."""
    import time
    import types

    from spark_client.consumer import Consumer

    consumer = Consumer.__new__(Consumer)
    at = {("t", 0): 0}
    consumer.position = lambda topic, partition: at[(topic, partition)]

    def wait_for_data(timeout_s):
        time.sleep(0.02)
        at[("t", 0)] += 1  # a fetch passed aborted data: nothing to take

    consumer._wait_for_data = wait_for_data
    nothing = lambda max_records, ends: []  # noqa: E731
    consumer._fetched = types.SimpleNamespace(take_messages=nothing, take_table=nothing,
                                              take_blocks=nothing)
    assert list(consumer.read_until({("t", 0): 10}, idle_timeout_s=0.05)) == []
    assert at[("t", 0)] == 10
