"""The SDK producer's decision after UNKNOWN_PRODUCER_ID (spark_client/producer.py,
`_reset_identity`), on its state alone: a fake client hands out producer ids, nothing
goes over a network (the send path is not run)."""

from __future__ import annotations

import time

from spark_client import errors
from spark_client import producer as sdk


class _Metadata:
    coordinators: list = []

    def partitions(self, topic):
        return [0]


class _Client:
    metadata = _Metadata()

    def __init__(self):
        self.ids = iter(range(100, 200))

    def allocate_producer_id(self):
        return next(self.ids), 0


def _in_flight(producer: sdk.Producer, maybe_written: bool):
    """A partition whose one batch (producer id 100, sequence 0) is sent, unanswered."""
    state = producer._partitions[("t", 0)] = sdk._PartitionState()
    batch = sdk._Batch("t", 0, [object()], sdk._Outcome("t", 0), time.monotonic(), 10)
    batch.deadline = time.monotonic() + 120
    batch.base_sequence, batch.payload, batch.attempts, batch.producer_id = 0, b"x", 1, 100
    batch.maybe_written = maybe_written
    state.producer_id, state.next_sequence = 100, 1
    state.in_flight.append(batch)
    state.window.append(batch)
    producer._unfinished += 1
    producer._buffered_bytes += 10
    return state, batch


def test_a_batch_refused_as_of_an_unknown_producer_is_sent_again_under_a_new_id():
    """The partition forgot the producer (idle past its expiry, or a leader that rebuilt
    its state from a log whose start had passed the producer's last batch), and no
    attempt of the batch may have been written: until 2026-12-06 its records failed
    (UnknownProducerId) though resending them is safe. Now they go again under a new
    producer id from sequence 0 (KIP-360); with an earlier attempt unanswered (maybe
    written) they still fail, as resending could write them twice."""
    producer = sdk.Producer(_Client(), linger_ms=1000)
    unknown = errors.error_for("UNKNOWN_PRODUCER_ID", "producer 100 has no state here")
    try:
        with producer._lock:
            state, batch = _in_flight(producer, maybe_written=False)
            producer._handle_failure(batch, state, unknown)
            assert not batch.outcome.settled
            assert (state.producer_id, state.next_sequence) == (101, 0)
            assert list(state.ready) == [batch] and not state.in_flight
            assert batch.payload == b""  # encoded again, under the new id
            state.ready.clear()
            producer._unfinished -= 1
            producer._buffered_bytes -= 10

            state, batch = _in_flight(producer, maybe_written=True)
            producer._handle_failure(batch, state, unknown)
            assert batch.outcome.settled
            assert isinstance(batch.outcome.error, errors.UnknownProducerId)
    finally:
        producer.close()


def test_a_batch_whose_encoding_rotates_the_producer_id_waits_for_the_old_ids_batches():
    """Sequences may not pass 2^31 - 1: the batch that would is encoded under a new
    producer id. It went while batches of the old id were unanswered, so a retry of one
    of those landed after it (out of order), against the rule that a new id waits for
    every batch of the old one to be answered."""
    state = sdk._PartitionState()
    old = sdk._Batch("t", 0, [object()], sdk._Outcome("t", 0), time.monotonic(), 10)
    old.payload, old.attempts, old.producer_id = b"x", 1, 100
    state.producer_id, state.next_sequence = 100, sdk.SEQUENCE_LIMIT - 1
    state.in_flight.append(old)
    state.window.append(old)
    rotating = sdk._Batch("t", 0, [object(), object()], sdk._Outcome("t", 0),
                          time.monotonic(), 10)
    state.ready.append(rotating)
    assert not sdk._may_send(state, 5)
    state.in_flight.clear()
    assert sdk._may_send(state, 5)
    fits = sdk._Batch("t", 0, [object()], sdk._Outcome("t", 0), time.monotonic(), 10)
    state.ready.appendleft(fits)  # (one record still fits under the old id)
    state.in_flight.append(old)
    assert sdk._may_send(state, 5)
