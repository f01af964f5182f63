"""The subscription consumer's individual acks (spark_client/subscriber.py `_individual`):
the ranges it sends for a list of messages, whatever their order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from spark_client.fetched import Message
from spark_client.subscriber import _individual


def _check_runs(messages, got: dict) -> None:
    """What the acks must be, stated without building them: per partition, in (topic,
    partition) order, ranges in ascending order that hold exactly the messages' offsets
    (a repeated offset as often as it came), each as long as it can be: a range never
    ends where the next one starts."""
    assert list(got) == sorted({(m.topic, m.partition) for m in messages})
    for key, (cumulative, spans) in got.items():
        assert cumulative == 0
        offsets = sorted(m.offset for m in messages if (m.topic, m.partition) == key)
        assert [o for start, end in spans for o in range(start, end)] == offsets
        assert all(start < end for start, end in spans)
        assert all(a[1] != b[0] for a, b in zip(spans, spans[1:])), spans


def _message(topic: str, partition: int, offset: int) -> Message:
    return Message(topic, partition, offset, None, b"v", (), 0)


_MESSAGES = st.lists(st.builds(_message, st.sampled_from(["a", "b"]), st.integers(0, 2),
                               st.integers(0, 40)), max_size=60)


def _poll_order(messages, rng) -> list:
    """The messages as polls hand them out: each offset once, in offset order within its
    partition, the partitions interleaved at random."""
    queues: dict = {}
    for m in sorted(set(messages), key=lambda m: m.offset):
        queues.setdefault((m.topic, m.partition), []).append(m)
    out = []
    while queues:
        key = rng.choice(sorted(queues))
        out.append(queues[key].pop(0))
        if not queues[key]:
            del queues[key]
    return out


@settings(max_examples=400, deadline=None)
@given(_MESSAGES, st.randoms(use_true_random=False), st.booleans())
def test_individual_acks_are_the_sorted_runs_in_any_order(messages, rng, poll_order):
    if poll_order:
        messages = _poll_order(messages, rng)
    _check_runs(messages, _individual(messages))


def test_a_poll_of_one_partition_is_one_range_and_a_gap_starts_another():
    messages = [_message("t", 0, o) for o in (5, 6, 7, 9, 10)]
    assert _individual(messages) == {("t", 0): (0, [(5, 8), (9, 11)])}
    assert _individual(messages[0]) == {("t", 0): (0, [(5, 6)])}
    assert _individual(list(reversed(messages))) == {("t", 0): (0, [(5, 8), (9, 11)])}
    assert _individual([]) == {}
