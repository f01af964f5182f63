"""The rule for an unreplicated partition's copy at open (partition_server/copies.py)."""

from partition_server.copies import Verdict, lost_detail, verdict

MINE = {"server": "ps-0", "topic_created_unix_ms": 1000, "recorded_unix_ms": 2000}


def test_a_recorded_copy_with_its_directory_opens():
    assert verdict(True, MINE, "ps-0", 1000) is Verdict.OPEN


def test_a_recorded_copy_without_its_directory_is_lost():
    assert verdict(False, MINE, "ps-0", 1000) is Verdict.LOST


def test_a_new_partition_is_recorded_with_or_without_its_directory():
    assert verdict(False, None, "ps-0", 1000) is Verdict.RECORD
    # made before this rule existed, or its record not written before a crash
    assert verdict(True, None, "ps-0", 1000) is Verdict.RECORD


def test_a_record_of_an_earlier_topic_of_the_same_name_does_not_count():
    assert verdict(False, MINE, "ps-0", 3000) is Verdict.RECORD
    assert verdict(True, MINE, "ps-0", 3000) is Verdict.RECORD


def test_a_record_of_another_server_does_not_count():
    assert verdict(False, MINE, "ps-1", 1000) is Verdict.RECORD


def test_an_unreadable_record_does_not_count():
    assert verdict(False, {"server": "ps-0"}, "ps-0", 1000) is Verdict.RECORD


def test_the_detail_says_when_the_copy_was_recorded_and_what_to_do():
    detail = lost_detail(MINE)
    assert "1970-01-01 00:00:02 UTC" in detail and "atomlog partition recover" in detail
    assert "an earlier start" in lost_detail({"server": "ps-0"})
