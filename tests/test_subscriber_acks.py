"""The subscription consumer's individual acks (spark_client/subscriber.py `_individual`):
the ranges it sends for a list of messages, whatever their order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from spark_client.fetched import Message
from spark_client.subscriber import _individual


def _reference(messages) -> dict:
    """Per partition, in (topic, partition) order: the messages' offsets sorted, each run
    of consecutive offsets one range (a repeated offset starts a range of its own)."""
    ranges: dict = {}
    for m in sorted(messages, key=lambda m: (m.topic, m.partition, m.offset)):
        spans = ranges.setdefault((m.topic, m.partition), [])
        if spans and spans[-1][1] == m.offset:
            spans[-1] = (spans[-1][0], m.offset + 1)
        else:
            spans.append((m.offset, m.offset + 1))
    return {key: (0, spans) for key, spans in ranges.items()}


def _message(topic: str, partition: int, offset: int) -> Message:
    return Message(topic, partition, offset, None, b"v", (), 0)


_MESSAGES = st.lists(st.builds(_message, st.sampled_from(["a", "b"]), st.integers(0, 2),
                               st.integers(0, 40)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(_MESSAGES, st.randoms(use_true_random=False), st.booleans())
def test_individual_acks_are_the_sorted_runs_in_any_order(messages, rng, poll_order):
    if poll_order:  # as a poll hands them out: offset order within each partition
        messages = sorted(set(messages), key=lambda m: (m.topic, m.partition, m.offset))
        rng.shuffle(messages)
        messages.sort(key=lambda m: (m.topic, m.partition, m.offset))
    got = _individual(messages)
    assert got == _reference(messages)
    assert list(got) == sorted(got)  # the partitions in order, as before


def test_a_poll_of_one_partition_is_one_range_and_a_gap_starts_another():
    messages = [_message("t", 0, o) for o in (5, 6, 7, 9, 10)]
    assert _individual(messages) == {("t", 0): (0, [(5, 8), (9, 11)])}
    assert _individual(messages[0]) == {("t", 0): (0, [(5, 6)])}
    assert _individual(list(reversed(messages))) == {("t", 0): (0, [(5, 8), (9, 11)])}
    assert _individual([]) == {}
