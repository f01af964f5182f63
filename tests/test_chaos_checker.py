"""The chaos checker (tests/chaos/checker.py) on hand-made histories: a clean history is
valid, and each anomaly is found on a minimal history that holds only it."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.chaos.checker import ANOMALIES, DESCRIPTIONS, check, check_file, format_report
from tests.chaos.history import write_history

RC, RU = "read_committed", "read_uncommitted"


class History:
    """Builds a history and, beside it, the log it implies: every write lands in its
    partition at the next offset (visible or not to read_committed readers), and
    finish() derives the final reads and final positions from that log."""

    def __init__(self):
        self.ops: list[dict] = []
        self.clock = 1000.0
        self.log: dict[tuple, list[tuple]] = defaultdict(list)  # (t, p) -> [(value, vis)]
        self.positions: dict[str, list] = {}  # value -> [topic, partition, offset]
        self.txn_count = 0

    def op(self, f: str, process: str, invoke: float | None = None, duration: float = 0.5,
           outcome: str = "ok", **fields) -> dict:
        if invoke is None:
            self.clock += 1
            invoke = self.clock
        operation = {"process": process, "f": f, "invoke": invoke,
                     "complete": None if duration is None else invoke + duration,
                     "outcome": outcome, **fields}
        self.ops.append(operation)
        return operation

    def append(self, topic: str, partition: int, value: str, visible: bool = True) -> int:
        """Put a record in the log directly (no op wrote it)."""
        entries = self.log[(topic, partition)]
        entries.append((value, visible))
        self.positions.setdefault(value, [topic, partition, len(entries) - 1])
        return len(entries) - 1

    def record(self, value: str) -> list:
        return [*self.positions[value], value]

    def workload(self, **fields) -> dict:
        return self.op("workload", "runner", duration=0, workload="test", seed=1, **fields)

    def send(self, value: str, topic: str = "t", partition: int = 0, outcome: str = "ok",
             lands: bool | None = None, offset: int | None = None, **fields) -> dict:
        lands = outcome == "ok" if lands is None else lands
        if lands:
            landed = self.append(topic, partition, value)
            offset = landed if offset is None else offset
        if outcome == "ok" and offset is not None:
            fields["offset"] = offset
        return self.op("send", "producer-0", outcome=outcome, topic=topic,
                       partition=partition, value=value, **fields)

    def txn(self, writes: list, result: str = "committed", visible=None,
            decision: str = "commit", acks: tuple = (), process: str = "producer-1",
            **fields) -> dict:
        """writes: values (topic "t", partition 0) or (topic, partition, value). Every
        write lands in the log; visible: None (= committed), a bool, or one per write."""
        writes = [list(w) if isinstance(w, (list, tuple)) else ["t", 0, w] for w in writes]
        if visible is None:
            visible = result == "committed"
        if isinstance(visible, bool):
            visible = [visible] * len(writes)
        for (topic, partition, value), shown in zip(writes, visible):
            self.append(topic, partition, value, shown)
        self.txn_count += 1
        return self.op("txn", process, writes=writes, acks=[list(a) for a in acks],
                       decision=decision, result=result, txn_id=f"tc:{self.txn_count}",
                       **fields)

    def poll(self, values: list[str] = (), records: list | None = None, session: str = "s1",
             isolation: str = RC, subscription: str | None = None,
             process: str = "reader-0", **fields) -> dict:
        records = [self.record(v) for v in values] if records is None else records
        return self.op("poll", process, session=session, isolation=isolation,
                       subscription=subscription, records=records, **fields)

    def seek(self, positions: list, session: str = "s1", isolation: str = RC) -> dict:
        return self.op("seek", "reader-0", session=session, isolation=isolation,
                       positions=[list(p) for p in positions])

    def fence(self, transactional_id: str, epoch: int, **fields) -> dict:
        return self.op("fence", "producer-1", transactional_id=transactional_id, epoch=epoch,
                       **fields)

    def cursor(self, subscription: str, topic: str, positions: list,
               process: str = "ctp-0", **fields) -> dict:
        return self.op("cursor", process, subscription=subscription, topic=topic,
                       positions=[list(p) for p in positions], **fields)

    def nemesis(self, fault: str = "kill", target: str = "partition-0",
                duration: float | None = 2.0) -> dict:
        return self.op("nemesis", "nemesis", duration=duration, fault=fault, target=target,
                       detail="")

    def final_read(self, isolation: str = RC) -> dict:
        records, ends = [], []
        for (topic, partition), entries in sorted(self.log.items()):
            records += [[topic, partition, offset, value]
                        for offset, (value, shown) in enumerate(entries)
                        if shown or isolation == RU]
            ends.append([topic, partition, len(entries)])
        return self.op("final-read", "final", isolation=isolation, records=records,
                       ends=ends)

    def final_positions(self, **overrides) -> dict:
        partitions = [{"topic": topic, "partition": partition,
                       "high_watermark": len(entries), "max_read_position": len(entries),
                       "open_txns": []}
                      for (topic, partition), entries in sorted(self.log.items())]
        for entry in partitions:
            entry.update(overrides)
        return self.op("final-positions", "final", partitions=partitions)

    def finish(self, committed: bool = True, uncommitted: bool = True,
               positions: bool = True) -> list[dict]:
        if committed:
            self.final_read(RC)
        if uncommitted:
            self.final_read(RU)
        if positions:
            self.final_positions()
        return self.ops


def nonzero(report: dict) -> dict:
    return {name: count for name, count in report["anomalies"].items() if count}


def assert_only(report: dict, name: str, count: int | None = None) -> None:
    """The report holds the anomaly `name` (count times, if given) and nothing else."""
    found = nonzero(report)
    assert set(found) == {name}, (found, report["examples"])
    if count is not None:
        assert found[name] == count, report["examples"][name]
    assert report["examples"][name], "an anomaly comes with examples"
    assert report["valid"] is False
    assert report["problems"] == []


def assert_valid(report: dict) -> None:
    assert report["problems"] == [], report["problems"]
    assert nonzero(report) == {}, report["examples"]
    assert report["valid"] is True


def ctp_history() -> History:
    history = History()
    history.workload(input_topic="in", output_topic="out", subscription="sub",
                     transform="out:")
    return history


# ---------------------------------------------------------------- clean histories


def clean_history() -> History:
    history = History()
    history.workload(topics={"t": 2})
    history.seek([("t", 0, 0)], session="s1")
    history.send("a")
    history.send("b", partition=1)
    history.txn(["c", ("t", 1, "d")])
    history.txn(["e", "f"], result="aborted")                   # in the log, never shown
    history.txn(["g"], decision="abort", result="aborted")
    history.nemesis("kill", "partition-0")
    history.txn(["h"])
    history.send("i", outcome="unknown", lands=True)
    history.send("j", outcome="unknown", lands=False)
    history.send("k", outcome="fail", lands=False)
    history.txn(["l", "m"], result="unknown", visible=True)
    history.txn(["n", "o"], result="unknown", visible=False)
    history.fence("tx", 1)
    history.txn(["p"], transactional_id="tx", epoch=1)
    history.fence("tx", 2)
    history.txn(["q"], transactional_id="tx", epoch=2)
    # t/0 holds a c e f g h i l m n o p q (offsets 0-12); e f g n o are not committed,
    # so an assigned read_committed session goes 1 -> 5 and 8 -> 11 skipping nothing
    history.poll(["a", "c"], session="s1")
    history.poll(["h", "i"], session="s1")
    history.poll(["l", "m", "p", "q"], session="s1")
    history.poll(["b", "d"], session="s1")
    # read_uncommitted sessions see everything, aborted records included
    history.seek([("t", 0, 2)], session="s2", isolation=RU)
    history.poll(["e", "f", "g", "h"], session="s2", isolation=RU)
    # a subscription reader, with a redelivery
    history.poll(["a", "c"], session="s3", subscription="sub")
    history.poll(["c", "h"], session="s3", subscription="sub")
    history.cursor("sub", "t", [(0, 1), (1, 0)])
    history.cursor("sub", "t", [(0, 2), (1, 1)])
    history.nemesis("pause", "coordinator", duration=None)
    return history


def test_a_clean_history_is_valid():
    report = check(clean_history().finish())
    assert_valid(report)
    assert set(report["anomalies"]) == set(ANOMALIES)
    assert set(report["examples"]) == set(ANOMALIES)
    stats = report["stats"]
    assert stats["committed_txns"] == 4 and stats["aborted_txns"] == 2
    assert stats["unknown_txns"] == 2 and stats["sends_ok"] == 2
    assert stats["polls"] == 7 and stats["records_read"] == 18
    assert stats["faults"] == 2 and stats["fault_seconds"] > 2.0
    json.dumps(report)


def test_the_names_are_described_in_order():
    assert ANOMALIES == ("lost-write", "duplicate", "aborted-read", "torn-transaction",
                         "inconsistent-offsets", "non-monotonic-poll", "skipped-poll",
                         "cursor-regression", "fenced-write-visible", "lost-ack",
                         "reordered-writes", "misplaced-write", "hanging-transaction", "vanished-read",
                         "diverged-replicas", "resurrected-delete", "stream-step-twice")
    assert set(DESCRIPTIONS) == set(ANOMALIES)


def test_unknown_ops_and_malformed_fields_are_ignored():
    history = History()
    history.send("a")
    history.op("bogus", "x")
    history.ops.append("not an op")
    history.poll(records=[["t", 0], None, ["t", 0, None, "z"]])
    history.op("txn", "producer-1", writes=None, acks=[["sub"]])
    report = check(history.finish())
    assert_valid(report)
    assert report["stats"]["ignored_ops"] == 2


# ---------------------------------------------------------------- unknown outcomes


@pytest.mark.parametrize("lands", [True, False])
def test_an_unknown_send_may_or_may_not_be_visible(lands):
    history = History()
    history.send("a")
    history.send("b", outcome="unknown", lands=lands)
    assert_valid(check(history.finish()))


@pytest.mark.parametrize("visible", [True, False])
def test_an_unknown_txn_may_be_wholly_visible_or_wholly_invisible(visible):
    history = History()
    history.txn(["a", "b", ("t", 1, "c")], result="unknown", visible=visible)
    assert_valid(check(history.finish()))


def test_an_unknown_txn_partly_visible_is_torn():
    history = History()
    history.txn(["a", "b", "c"], result="unknown", visible=[True, False, True])
    report = check(history.finish())
    assert_only(report, "torn-transaction", 1)
    example = report["examples"]["torn-transaction"][0]
    assert example["kind"] == "writes"
    assert example["visible"] == ["a", "c"] and example["invisible"] == ["b"]


# ---------------------------------------------------------------- each anomaly


def test_lost_write_of_a_send():
    history = History()
    history.send("a")
    history.send("b", lands=False, offset=1)
    report = check(history.finish())
    assert_only(report, "lost-write", 1)
    assert report["examples"]["lost-write"][0]["value"] == "b"


def test_lost_write_of_a_committed_txn():
    history = History()
    history.txn(["a"], visible=False)
    report = check(history.finish())
    assert_only(report, "lost-write", 1)
    assert report["examples"]["lost-write"][0]["kind"] == "txn"


def test_a_txn_write_visible_in_another_partition_is_misplaced():
    """A transaction's writes carry no offset, so inconsistent-offsets never saw one land
    in the wrong partition, and lost-write only asks whether the value is visible."""
    history = History()
    history.append("t", 1, "a")  # sent to t/0, landed in t/1
    history.op("txn", "producer-1", writes=[["t", 0, "a"]], acks=[], decision="commit",
               result="committed", txn_id="tc:1")
    history.txn([("t", 1, "b")])  # where it was sent: fine
    report = check(history.finish())
    assert_only(report, "misplaced-write", 1)
    [example] = report["examples"]["misplaced-write"]
    assert (example["value"], example["sent_to"], example["visible_at"][:2]) == (
        "a", ["t", 0], ["t", 1])


def test_a_committed_txn_partly_visible_is_torn_and_lost():
    history = History()
    history.txn(["a", "b"], visible=[True, False])
    report = check(history.finish())
    assert nonzero(report) == {"torn-transaction": 1, "lost-write": 1}


def test_duplicate_in_the_final_read():
    history = History()
    history.send("a")
    history.append("t", 0, "a")
    report = check(history.finish())
    assert_only(report, "duplicate", 1)
    assert report["examples"]["duplicate"][0]["positions"] == [["t", 0, 0], ["t", 0, 1]]


def test_duplicate_against_a_send_offset_is_reported_once():
    history = History()
    history.send("a", offset=5)
    history.poll(["a"], session="s1")
    history.poll(["a"], session="s2", isolation=RU)
    report = check(history.finish())
    assert_only(report, "duplicate", 1)


def test_an_aborted_one_call_attempt_beside_its_committed_retry_is_no_duplicate():
    """A one-call transaction staged, presumed aborted when its coordinator lost the TC
    partition, and run anew by the SDK's retry: one op, two copies in the log, the first
    aborted. Read_uncommitted readers see both; that is not a duplicate — but a second
    copy that read_committed readers see is."""
    history = History()
    history.append("t", 0, "v", visible=False)  # the aborted attempt
    first = history.positions["v"]
    history.txn(["v"])  # its committed retry, at the next offset
    del history.positions["v"]
    history.positions["v"] = [first[0], first[1], first[2] + 1]
    history.poll(records=[["t", 0, 0, "v"], ["t", 0, 1, "v"]], isolation=RU, session="u1")
    history.poll(records=[["t", 0, 1, "v"]])
    assert nonzero(check(history.finish())) == {}
    history.append("t", 0, "v")  # a visible second copy
    report = check(history.finish())
    assert_only(report, "duplicate", 1)


def test_aborted_read_in_a_poll():
    history = History()
    history.txn(["a"], result="aborted")
    history.poll(records=[["t", 0, 0, "a"]])
    report = check(history.finish())
    assert_only(report, "aborted-read", 1)
    assert report["examples"]["aborted-read"][0]["kind"] == "aborted"


def test_aborted_read_in_the_final_read():
    history = History()
    history.txn(["a"], result="aborted", visible=True)
    report = check(history.finish())
    assert_only(report, "aborted-read", 1)


def test_an_abort_decision_that_shows_is_an_aborted_read_whatever_its_result():
    history = History()
    history.txn(["a"], result="committed", decision="abort", visible=True)
    assert_only(check(history.finish()), "aborted-read", 1)


def test_a_read_uncommitted_reader_may_see_aborted_values():
    history = History()
    history.txn(["a"], result="aborted")
    history.poll(["a"], isolation=RU)
    assert_valid(check(history.finish()))


def test_a_phantom_is_an_aborted_read_of_an_unknown_write():
    history = History()
    history.send("a")
    history.append("t", 0, "ghost")
    report = check(history.finish())
    assert_only(report, "aborted-read", 1)
    example = report["examples"]["aborted-read"][0]
    assert example["kind"] == "unknown-write" and example["value"] == "ghost"


def test_inconsistent_offsets():
    history = History()
    history.send("a")
    history.send("b", outcome="unknown", lands=False)
    history.poll(records=[["t", 0, 0, "b"]], isolation=RU)
    report = check(history.finish())
    assert_only(report, "inconsistent-offsets", 1)
    assert report["examples"]["inconsistent-offsets"][0] == {"position": ["t", 0, 0],
                                                             "values": ["a", "b"]}


def test_non_monotonic_poll():
    history = History()
    history.send("a")
    history.send("b")
    history.poll(["a", "b"])
    history.poll(["a"])
    report = check(history.finish())
    assert_only(report, "non-monotonic-poll", 1)
    example = report["examples"]["non-monotonic-poll"][0]
    assert example["previous"]["offset"] == 1 and example["offset"] == 0


def test_a_seek_restarts_a_session():
    history = History()
    history.send("a")
    history.send("b")
    history.poll(["a", "b"])
    history.seek([("t", 0, 0)])
    history.poll(["a", "b"])
    assert_valid(check(history.finish()))


def test_a_redelivery_on_a_subscription_session_is_not_non_monotonic():
    history = History()
    history.send("a")
    history.send("b")
    history.poll(["a", "b"], subscription="sub")
    history.poll(["a"], subscription="sub")
    history.poll(["a", "a"], subscription="sub")
    assert_valid(check(history.finish()))


def test_skipped_poll_between_reads():
    history = History()
    for value in "abc":
        history.send(value)
    history.poll(["a"])
    history.poll(["c"])
    report = check(history.finish())
    assert_only(report, "skipped-poll", 1)
    assert report["examples"]["skipped-poll"][0]["skipped"] == [1]


def test_skipped_poll_after_a_seek():
    history = History()
    for value in "abc":
        history.send(value)
    history.seek([("t", 0, 0)])
    history.poll(["b", "c"])
    report = check(history.finish())
    assert_only(report, "skipped-poll", 1)
    assert report["examples"]["skipped-poll"][0]["after"] == "seek"


def test_a_read_uncommitted_session_is_compared_with_the_read_uncommitted_final_read():
    history = History()
    history.send("a")
    history.txn(["b"], result="aborted")
    history.send("c")
    history.poll(["a", "c"], isolation=RU)
    assert_only(check(history.finish()), "skipped-poll", 1)
    history.poll(["a", "c"], session="s2")          # read_committed: b is not readable
    assert nonzero(check(history.ops)) == {"skipped-poll": 1}


def test_cursor_regression():
    history = History()
    history.cursor("sub", "t", [(0, 5)])
    history.cursor("sub", "t", [(0, 3)])
    report = check(history.finish())
    assert_only(report, "cursor-regression", 1)
    example = report["examples"]["cursor-regression"][0]
    assert (example["earlier"], example["later"]) == ([5, ()], [3, ()])


def test_cursor_regression_of_an_individually_acknowledged_range():
    """Offsets acknowledged one by one above the cursor (the third element) must stay
    acknowledged: a later observation that lost them is a regression, one that moved the
    cursor over them is not."""
    history = History()
    history.cursor("sub", "t", [(0, 5, [[7, 9]])])
    history.cursor("sub", "t", [(0, 9, [])])
    history.cursor("sub", "t", [(0, 9, [[12, 14]])])
    assert nonzero(check(history.finish())) == {}
    history.cursor("sub", "t", [(0, 9, [[13, 14]])])
    report = check(history.ops)
    assert nonzero(report) == {"cursor-regression": 1}


def test_concurrent_cursor_observations_may_disagree():
    history = History()
    history.cursor("sub", "t", [(0, 5)], invoke=1.0, duration=10)
    history.cursor("sub", "t", [(0, 3)], invoke=2.0, duration=1)
    history.cursor("sub", "t", [(1, 7)], invoke=20.0)
    history.cursor("sub", "t", [(0, 6), (1, 7)], invoke=21.0)
    history.cursor("other", "t", [(0, 0)], invoke=22.0)
    assert_valid(check(history.finish()))


def test_fenced_write_visible():
    history = History()
    history.fence("tx", 1)
    history.fence("tx", 2)
    history.txn(["a"], transactional_id="tx", epoch=1)
    report = check(history.finish())
    assert_only(report, "fenced-write-visible", 1)
    assert report["examples"]["fenced-write-visible"][0]["fence_epoch"] == 2


def fenced_history(commit_after_fence: bool) -> list[dict]:
    history = History()
    history.fence("tx", 1)
    began = history.clock + 1
    commit = began + (10 if commit_after_fence else 1)
    history.txn(["a"], transactional_id="tx", epoch=1, invoke=began, duration=20,
                commit_invoke=commit)
    history.fence("tx", 2, invoke=began + 0.5, duration=1)  # completes at began + 1.5
    history.txn(["b"], transactional_id="tx", epoch=1, result="aborted")
    history.txn(["c"], transactional_id="tx", epoch=2)
    return history.finish()


def test_a_fence_only_counts_once_complete_before_the_commit():
    assert_valid(check(fenced_history(commit_after_fence=False)))
    report = check(fenced_history(commit_after_fence=True))
    assert_only(report, "fenced-write-visible", 1)
    assert report["examples"]["fenced-write-visible"][0]["visible"] == ["a"]


def test_a_stream_step_visible_from_two_parents_is_committed_twice():
    """spark-lite's jobs are the steps of a stream: a replay of a committed step by a
    forgotten key must be refused, so one step's writes come from one parent only."""
    history = History()
    step = {"stream": "s", "process": "driver-0"}
    history.txn(["a"], ordinal=0, parent="3:1", child=True, **step)
    history.txn(["b"], ordinal=0, parent="3:1", child=True, **step)  # its second task
    history.txn(["c"], ordinal=0, parent="3:2", child=True, result="aborted", **step)
    history.txn(["d"], ordinal=1, parent="3:3", child=True, **step)
    history.txn(["e"], ordinal=1, parent="3:4", child=True, result="unknown", visible=False,
                **step)
    assert_valid(check(history.finish()))
    history = History()
    history.txn(["a"], ordinal=0, parent="3:1", child=True, **step)
    history.txn(["b"], ordinal=0, parent="3:2", child=True, result="unknown", visible=True,
                **step)
    report = check(history.finish())
    assert_only(report, "stream-step-twice", 1)
    assert report["examples"]["stream-step-twice"][0]["parents"] == ["3:1", "3:2"]


def test_lost_ack():
    history = History()
    history.send("a", topic="in")
    history.poll(["a"], subscription="sub", session="c1")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)])
    history.poll(["a"], subscription="sub", session="c2")
    report = check(history.finish())
    assert_only(report, "lost-ack", 1)
    assert report["examples"]["lost-ack"][0]["ack"] == ["sub", "in", 0, 0]


def test_a_redelivery_before_the_ack_committed_is_not_a_lost_ack():
    history = History()
    history.send("a", topic="in")
    txn = history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], duration=10)
    history.poll(["a"], subscription="sub", invoke=txn["invoke"] + 1)   # before complete
    history.poll(["a"], subscription="other")                           # another subscription
    assert_valid(check(history.finish()))


def test_a_prefetched_message_is_judged_by_when_it_was_received():
    """A prefetching consumer's poll hands out what an earlier Receive delivered: a copy
    received before the ack committed is no lost ack, whenever the poll ran; one
    received after it is."""
    history = History()
    history.send("a", topic="in")
    txn = history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], duration=10)
    history.poll(["a"], subscription="sub", received=txn["invoke"] + 1)
    assert_valid(check(history.finish()))
    history = History()
    history.send("a", topic="in")
    txn = history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], duration=10)
    history.poll(["a"], subscription="sub", received=txn["complete"] + 1)
    assert_only(check(history.finish()), "lost-ack", 1)


def test_an_aborted_ack_may_be_redelivered():
    history = History()
    history.send("a", topic="in")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], result="aborted")
    history.poll(["a"], subscription="sub")
    assert_valid(check(history.finish()))


@pytest.mark.parametrize("overrides", [{"max_read_position": 0}, {"open_txns": ["tc:9"]}])
def test_hanging_transaction(overrides):
    history = History()
    history.send("a")
    history.finish(positions=False)
    history.final_positions(**overrides)
    report = check(history.ops)
    assert_only(report, "hanging-transaction", 1)
    assert report["examples"]["hanging-transaction"][0]["topic"] == "t"


def copy(server: str, bases=(0, 40, 90), end: int = 120, digest: str = "d1") -> dict:
    return {"server": server, "bases": list(bases), "end": end, "digest": digest}


@pytest.mark.parametrize("case", ["bases", "batches", "end", "both"])
def test_diverged_replicas(case):
    """The last ok replicas op decides: copies whose segments start elsewhere, or whose
    batches differ, are one instance per partition; equal copies are none."""
    other = {"bases": copy("ps-1", bases=(0, 40)), "batches": copy("ps-1", digest="d2"),
             "end": copy("ps-1", end=119),
             "both": copy("ps-1", bases=(0, 41, 90), digest="d2")}[case]
    history = History()
    history.send("a")
    history.finish()
    history.op("replicas", "final", partitions=[
        {"topic": "t", "partition": 0, "copies": [copy("ps-0"), copy("ps-2")]}],
        invoke=900.0)  # older: overridden by the next
    history.op("replicas", "final", partitions=[
        {"topic": "t", "partition": 0, "copies": [copy("ps-0"), other, copy("ps-2")]},
        {"topic": "t", "partition": 1, "copies": [copy("ps-0"), copy("ps-1")]}])
    history.op("replicas", "final", outcome="fail", partitions=[])  # not ok: ignored
    report = check(history.ops)
    assert_only(report, "diverged-replicas", 1)
    example = report["examples"]["diverged-replicas"][0]
    assert (example["topic"], example["partition"]) == ("t", 0)
    assert example["kind"] == {"bases": "segment-bases", "batches": "batches",
                               "end": "batches", "both": "segment-bases+batches"}[case]
    same = History()
    same.send("a")
    same.finish()
    same.op("replicas", "final", out_of_sync=[], partitions=[
        {"topic": "t", "partition": 0, "copies": [copy("ps-0"), copy("ps-1")]}])
    assert_valid(check(same.ops))
    short = History()
    short.send("a")
    short.finish()
    short.op("replicas", "final", out_of_sync=["__txn_log/5"], partitions=[
        {"topic": "t", "partition": 0, "copies": [copy("ps-0"), copy("ps-1")]}])
    report = check(short.ops)
    assert_only(report, "diverged-replicas", 1)
    assert report["examples"]["diverged-replicas"][0] == {"kind": "out-of-sync",
                                                          "partition": "__txn_log/5"}
    # A replicated run whose replicas op failed (ZooKeeper unreadable) decided nothing.
    undecided = History()
    undecided.send("a")
    undecided.finish()
    undecided.op("replicas", "final", outcome="fail", partitions=[], out_of_sync=[])
    report = check(undecided.ops)
    assert not report["valid"] and "diverged-replicas was not decided" in report["problems"][0]


def trim_history(final: list, starts: list, delete_outcome: str = "ok") -> History:
    """The trimmer's ops on partition 0 of the trim topic: sends of v0-v5 at offsets 0-5,
    a delete below 3 answered with log start 2, then the final trim read of `final`
    ([partition, offset, value]) with log starts `starts`."""
    history = History()
    history.send("a")
    history.finish()
    for offset in range(6):
        history.op("trim-send", "trimmer-0", topic="trim", partition=0, value=f"v{offset}",
                   offset=offset)
    history.op("delete", "trimmer-0", topic="trim", partition=0, before_offset=3,
               outcome=delete_outcome, **({"log_start": 2} if delete_outcome == "ok" else {}))
    history.op("final-trim-read", "final", topic="trim", records=final, starts=starts,
               ends=[[0, 6]])
    return history


def test_a_record_read_below_an_acknowledged_delete_is_resurrected():
    kept = [[0, offset, f"v{offset}"] for offset in range(2, 6)]
    report = check(trim_history(kept, [[0, 2]]).ops)
    assert_valid(report)
    assert report["stats"]["trim_sends_ok"] == 6 and report["stats"]["deletes_ok"] == 1
    # A replica that never deleted led at the end: offsets 0-1 are back.
    back = [[0, offset, f"v{offset}"] for offset in range(6)]
    report = check(trim_history(back, [[0, 0]]).ops)
    assert_only(report, "resurrected-delete", 1)
    example = report["examples"]["resurrected-delete"][0]
    assert example["kind"] == "read-below-start"
    assert (example["acknowledged_start"], example["final_start"], example["lowest"]) == (2, 0, 0)
    # A delete whose outcome is unknown acknowledged nothing: what stays below it is fine.
    assert_valid(check(trim_history(back, [[0, 0]], delete_outcome="unknown").ops))


def test_a_write_above_every_delete_gone_from_the_trim_topic_is_lost():
    # v3 (offset 3, at the delete's before_offset) must stay; v2 may go (below 3).
    report = check(trim_history([[0, 4, "v4"], [0, 5, "v5"]], [[0, 4]]).ops)
    assert_only(report, "resurrected-delete", 1)
    example = report["examples"]["resurrected-delete"][0]
    assert (example["kind"], example["offset"], example["value"]) == ("trim-lost-write", 3, "v3")
    # Without a final trim read nothing is decided, and the report says so.
    history = trim_history([], [])
    history.ops.pop()
    report = check(history.ops)
    assert not report["valid"]
    assert any("resurrected-delete was not decided" in p for p in report["problems"])


def test_reordered_writes_of_one_producer():
    history = History()
    # The later transaction's write landed first (offset 0), the earlier's after it.
    history.txn([("t", 0, "b"), ("t", 1, "y")], producer="txn-0-0", invoke=2000.0,
                commit="async")
    history.txn([("t", 0, "a"), ("t", 1, "x")], producer="txn-0-0", invoke=1990.0,
                commit="async")
    report = check(history.finish())
    assert_only(report, "reordered-writes", 2)
    example = report["examples"]["reordered-writes"][0]
    assert (example["value"], example["earlier_value"]) == ("b", "a")


def test_a_transactions_own_writes_to_a_partition_landing_reversed_are_reordered():
    """Send order holds within a transaction too; its writes were only compared with
    other transactions' (a hand-made history with two of one transaction's writes
    reversed passed)."""
    history = History()
    history.append("t", 0, "b")
    history.append("t", 0, "a")
    history.op("txn", "producer-1", writes=[["t", 0, "a"], ["t", 0, "b"]], acks=[],
               decision="commit", result="committed", txn_id="tc:1", producer="txn-0-0")
    report = check(history.finish())
    assert_only(report, "reordered-writes", 1)
    assert report["examples"]["reordered-writes"][0]["kind"] == "txn-order"


@pytest.mark.parametrize("case", ["other-producer", "no-producer", "aborted", "one-txn",
                                  "in-order"])
def test_what_is_not_a_reordering(case):
    history = History()
    second = {"other-producer": "txn-1-0", "no-producer": None}.get(case, "txn-0-0")
    if case == "one-txn":
        history.txn([("t", 0, "a"), ("t", 0, "b")], producer="txn-0-0")
    elif case == "in-order":
        history.txn(["a"], producer="txn-0-0", invoke=1990.0)
        history.txn(["b"], producer="txn-0-0", invoke=2000.0)
    else:
        history.txn(["b"], producer=second, invoke=2000.0)
        history.txn(["a"], producer="txn-0-0", invoke=1990.0,
                    **({"result": "aborted", "visible": False} if case == "aborted" else {}))
    assert nonzero(check(history.finish())) == {}


def test_the_last_final_positions_op_counts():
    history = History()
    history.send("a")
    history.finish(positions=False)
    history.final_positions(open_txns=["tc:1"])
    history.final_positions()
    assert_valid(check(history.ops))


def test_vanished_read():
    history = History()
    history.send("a", outcome="unknown", lands=False)
    history.poll(records=[["t", 0, 0, "a"]])
    report = check(history.finish())
    assert_only(report, "vanished-read", 1)
    assert report["examples"]["vanished-read"][0]["value"] == "a"


def test_a_committed_value_seen_then_gone_is_lost_and_vanished():
    history = History()
    history.send("a", lands=False, offset=0)
    history.poll(records=[["t", 0, 0, "a"]])
    assert nonzero(check(history.finish())) == {"lost-write": 1, "vanished-read": 1}


# ---------------------------------------------------------------- torn acks


def acking_history(result: str, visible: bool, cursor: int) -> History:
    history = History()
    history.send("a", topic="in")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], result=result,
                visible=visible)
    history.cursor("sub", "in", [(0, cursor)], process="final")
    return history


@pytest.mark.parametrize("result,visible,cursor", [
    ("committed", True, 1), ("unknown", True, 1), ("unknown", False, 0),
    ("aborted", False, 0)])
def test_acks_agreeing_with_the_writes(result, visible, cursor):
    assert_valid(check(acking_history(result, visible, cursor).finish()))


@pytest.mark.parametrize("result", ["committed", "unknown"])
def test_visible_writes_with_acks_not_applied_are_torn(result):
    report = check(acking_history(result, True, 0).finish())
    assert_only(report, "torn-transaction", 1)
    assert report["examples"]["torn-transaction"][0]["kind"] == "acks-not-applied"


def test_invisible_unknown_writes_with_applied_acks_are_torn():
    report = check(acking_history("unknown", False, 1).finish())
    assert_only(report, "torn-transaction", 1)
    assert report["examples"]["torn-transaction"][0]["kind"] == "acks-applied-without-writes"


def test_an_ack_applied_by_another_txn_is_not_torn():
    history = History()
    history.send("a", topic="in")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)], result="unknown",
                visible=False)
    history.txn([("out", 0, "out:a2")], acks=[("sub", "in", 0, 0)])
    history.cursor("sub", "in", [(0, 1)], process="final")
    assert_valid(check(history.finish()))


def test_the_cursor_may_stop_at_an_input_nobody_acknowledged():
    history = History()
    history.send("a", topic="in")
    history.send("b", topic="in")
    history.txn([("out", 0, "out:b")], acks=[("sub", "in", 0, 1)])
    history.cursor("sub", "in", [(0, 0)], process="final")
    assert_valid(check(history.finish()))


# ---------------------------------------------------------------- ctp


def test_a_clean_ctp_run_with_a_retried_output_is_valid():
    history = ctp_history()
    history.send("a", topic="in")
    history.send("b", topic="in")
    history.poll(["a", "b"], subscription="sub", session="c1")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)])
    history.txn([("out", 0, "out:b")], acks=[("sub", "in", 0, 1)], result="aborted")
    history.poll(["b"], subscription="sub", session="c1")          # redelivered
    history.txn([("out", 0, "out:b")], acks=[("sub", "in", 0, 1)])  # same output value
    history.cursor("sub", "in", [(0, 2)], process="final")
    report = check(history.finish())
    assert_valid(report)


def test_ctp_duplicate_output():
    history = ctp_history()
    history.send("a", topic="in")
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)])
    history.txn([("out", 0, "out:a")], acks=[("sub", "in", 0, 0)])
    history.cursor("sub", "in", [(0, 1)], process="final")
    report = check(history.finish())
    assert_only(report, "duplicate", 1)
    example = report["examples"]["duplicate"][0]
    assert example["kind"] == "ctp-output" and example["value"] == "out:a"
    assert example["input"] == {"value": "a", "position": ["in", 0, 0]}
    assert example["positions"] == [["out", 0, 0], ["out", 0, 1]]


def test_ctp_acked_input_without_output():
    history = ctp_history()
    history.send("a", topic="in")
    history.send("b", topic="in")
    history.txn([("out", 0, "out:b")], acks=[("sub", "in", 0, 1)])
    history.cursor("sub", "in", [(0, 2)], process="final")
    report = check(history.finish())
    assert_only(report, "lost-write", 1)
    example = report["examples"]["lost-write"][0]
    assert example["kind"] == "ctp-acked-without-output" and example["value"] == "out:a"


def test_ctp_unacknowledged_input_without_output_is_fine():
    history = ctp_history()
    history.send("a", topic="in")
    history.cursor("sub", "in", [(0, 0)], process="final")
    assert_valid(check(history.finish()))


def test_ctp_without_a_final_cursor_is_a_problem():
    history = ctp_history()
    history.send("a", topic="in")
    report = check(history.finish())
    assert report["valid"] is False and any("cursor" in p for p in report["problems"])


# ---------------------------------------------------------------- problems and report


def test_a_missing_final_read_is_a_problem():
    history = History()
    history.send("a", lands=False, offset=0)
    history.poll(records=[["t", 0, 0, "a"]])
    report = check(history.finish(committed=False))
    assert report["valid"] is False
    assert any("read_committed final-read" in p for p in report["problems"])
    assert report["anomalies"]["lost-write"] == 0  # not decided
    assert report["anomalies"]["vanished-read"] == 0


def test_a_failed_final_read_does_not_count():
    history = History()
    history.send("a")
    history.finish()
    for op in history.ops:
        if op["f"] == "final-read" and op["isolation"] == RC:
            op["outcome"] = "unknown"
    assert check(history.ops)["problems"]


def test_missing_final_positions_is_a_problem():
    history = History()
    history.send("a")
    report = check(history.finish(positions=False))
    assert report["valid"] is False and len(report["problems"]) == 1
    assert "final-positions" in report["problems"][0]


def test_read_uncommitted_sessions_without_their_final_read_are_a_problem():
    history = History()
    history.send("a")
    history.poll(["a"], isolation=RU)
    assert check(history.finish(uncommitted=False))["problems"]


def test_format_report_names_every_nonzero_anomaly():
    history = History()
    history.send("a")
    history.send("b", lands=False, offset=5)                      # lost-write
    history.txn(["c"], result="aborted", visible=True)            # aborted-read
    history.cursor("sub", "t", [(0, 5)])
    history.cursor("sub", "t", [(0, 3)])                          # cursor-regression
    report = check(history.finish())
    text = format_report(report)
    assert set(nonzero(report)) == {"lost-write", "aborted-read", "cursor-regression"}
    for name in nonzero(report):
        assert f"{name} examples:" in text
    for name in ANOMALIES:
        assert name in text
    assert text.startswith("valid: False")
    assert "valid: True" in format_report(check(clean_history().finish()))


def test_check_file_reads_a_history(tmp_path):
    path = write_history(tmp_path, clean_history().finish())
    assert_valid(check_file(path))


def test_examples_are_capped_at_ten():
    history = History()
    for number in range(15):
        history.send(f"v{number}", lands=False, offset=number)
    report = check(history.finish())
    assert report["anomalies"]["lost-write"] == 15
    assert len(report["examples"]["lost-write"]) == 10


# ---------------------------------------------------------------- property


SENDS = st.tuples(st.just("send"), st.integers(0, 2), st.sampled_from(["ok", "unknown", "fail"]),
                  st.booleans())
TXNS = st.tuples(st.just("txn"), st.lists(st.integers(0, 2), min_size=1, max_size=3),
                 st.sampled_from(["committed", "aborted", "unknown", "abort-decision"]),
                 st.booleans())


def model_history(actions: list, chunk: int) -> tuple[History, list[tuple[str, int]]]:
    """A history of the actions as a correct system would run them, read back by one
    assigned read_committed session per partition; and the definitely committed values
    with how many writes their op had."""
    history = History()
    committed: list[tuple[str, int]] = []
    for number, (kind, where, outcome, lands) in enumerate(actions):
        if kind == "send":
            value = f"s{number}"
            history.send(value, partition=where, outcome=outcome,
                         lands=outcome == "ok" or (outcome == "unknown" and lands))
            if outcome == "ok":
                committed.append((value, 1))
        else:
            writes = [("t", partition, f"x{number}.{i}") for i, partition in enumerate(where)]
            decision = "abort" if outcome == "abort-decision" else "commit"
            result = "aborted" if decision == "abort" else outcome
            history.txn(writes, result=result, decision=decision,
                        visible=result == "committed" or (result == "unknown" and lands))
            if result == "committed":
                committed += [(value, len(writes)) for _, _, value in writes]
    for partition in range(3):
        session = f"reader-{partition}"
        history.seek([("t", partition, 0)], session=session)
        shown = [value for value, visible in history.log[("t", partition)] if visible]
        for start in range(0, len(shown), chunk):
            history.poll(shown[start:start + chunk], session=session)
    history.finish()
    return history, committed


@settings(max_examples=150, deadline=None)
@given(actions=st.lists(st.one_of(SENDS, TXNS), min_size=1, max_size=25),
       chunk=st.integers(1, 4), data=st.data())
def test_model_histories_are_valid_and_a_removed_committed_value_is_caught(actions, chunk,
                                                                          data):
    history, committed = model_history(actions, chunk)
    report = check(history.ops)
    assert_valid(report)
    if not committed:
        return
    value, writes = data.draw(st.sampled_from(committed))
    final = next(op for op in history.ops if op["f"] == "final-read" and op["isolation"] == RC)
    final["records"] = [record for record in final["records"] if record[3] != value]
    report = check(history.ops)
    assert report["valid"] is False
    assert report["anomalies"]["lost-write"] >= 1
    if writes > 1:
        assert report["anomalies"]["torn-transaction"] >= 1


# ---------------------------------------------------------------- liveness: stalls


def failing_writer(history: History, process: str, start: float, seconds: float,
                   every: float = 10.0, error: str = "NOT_COORDINATOR") -> None:
    """Commits of `process` refused every `every` s from `start` for `seconds`."""
    moment = start
    while moment <= start + seconds:
        history.txn([f"{process}-{moment}"], result="aborted", visible=False,
                    process=process, invoke=moment, outcome="fail", error=error)
        moment += every


def test_a_writer_that_never_recovers_is_a_stall_though_exactly_once_held():
    history = clean_history()
    # the lease bug of 2026-12-02: one worker's commits refused for 130 s until the end,
    # while another worker committed all along
    failing_writer(history, "ctp-0", 2000.0, 130.0)
    for moment in range(2000, 2131, 5):
        history.txn([f"ok-{moment}"], process="ctp-1", invoke=float(moment))
    report = check(history.finish())
    assert nonzero(report) == {}
    assert report["valid"] is False
    [stall] = report["stalls"]
    assert stall["process"] == "ctp-0" and stall["ended"] == "never"
    assert stall["seconds"] == pytest.approx(130.5) and stall["attempts"] == 14
    assert stall["errors"] == ["NOT_COORDINATOR"]
    [problem] = report["problems"]
    assert problem.startswith("stall: ctp-0 made no progress for 130 s")
    assert "never recovered" in problem
    assert "stall: ctp-0" in format_report(report)


def test_failing_for_seconds_and_recovering_is_no_stall_and_is_measured():
    history = clean_history()
    failing_writer(history, "ctp-0", 2000.0, 20.0, every=2.0)
    history.txn(["back"], process="ctp-0", invoke=2021.0)
    report = check(history.finish())
    assert_valid(report)
    assert report["stalls"] == []
    assert report["stats"]["longest_failing_s"] == pytest.approx(21.5)


def test_failing_for_a_minute_then_recovering_is_a_stall():
    history = clean_history()
    failing_writer(history, "txn-0", 2000.0, 60.0, every=3.0, error="TRANSACTION_CONFLICT")
    history.txn(["back"], process="txn-0", invoke=2062.0)
    report = check(history.finish())
    [stall] = report["stalls"]
    assert stall["ended"] == "ok" and stall["seconds"] == pytest.approx(62.5)
    assert stall["attempts"] == 21 and report["valid"] is False


def test_one_ok_op_slower_than_the_limit_is_a_stall():
    history = clean_history()
    history.txn(["slow"], process="txn-0", invoke=2000.0, duration=50.0)
    report = check(history.finish())
    [stall] = report["stalls"]
    assert stall["attempts"] == 0 and stall["seconds"] == pytest.approx(50.0)
    assert "one slow op" in report["problems"][0]


def test_a_writer_that_stops_trying_stalls_nothing():
    history = clean_history()
    # a ctp worker with no input left for two minutes, and a client killed (its op in
    # flight never completes) and restarted
    history.txn(["before"], process="ctp-0", invoke=2000.0)
    history.txn(["after"], process="ctp-0", invoke=2120.0)
    history.txn(["killed"], process="ctp-1", invoke=2000.0, duration=None,
                result="unknown", visible=False, outcome="unknown")
    history.txn(["restarted"], process="ctp-1", invoke=2010.0)
    report = check(history.finish())
    assert_valid(report)
    assert report["stats"]["longest_failing_s"] == pytest.approx(10.5)
