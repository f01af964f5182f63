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


def test_inspect_reads_a_copy_without_opening_it(tmp_path):
    """A copy's span and latest leader epoch from its files: the last segment read to its
    last whole batch (a torn tail is not counted, and left as it is), a DATA_LOSS marker
    reported; a missing directory is no copy."""
    import os

    from partition_server.copies import inspect
    from partition_server.leader_epochs import LeaderEpochFile
    from partition_server.log import (DATA_LOSS_FILE, DataLoss, LogConfig, PartitionLog,
                                      encode_data_loss)
    from partition_server.record_batch import Record, encode_batch

    assert not inspect(tmp_path / "missing").present
    directory = tmp_path / "t-0"
    log = PartitionLog(directory, LogConfig(segment_bytes=4096))
    for i in range(40):
        log.append([encode_batch([Record(key=None, value=b"v" * 200)] * 2)])
    log.flush()
    epochs = LeaderEpochFile(directory, 0, log.log_end_offset)
    epochs.assign(3, 0)
    epochs.assign(5, 30)
    end, segments = log.log_end_offset, log.segment_count
    log.close()
    state = inspect(directory)
    assert state.present and (state.log_start_offset, state.log_end_offset) == (0, end) == (0, 80)
    assert (state.latest_leader_epoch, state.latest_epoch_start_offset) == (5, 30)
    assert state.segment_count == segments > 1 and state.tail_detail == ""
    last = sorted(directory.glob("*.log"))[-1]
    size = last.stat().st_size
    with open(last, "ab") as torn:
        torn.write(b"\x00\x00\x00\x00\x00\x00\x00\x50\x00\x00\x01")  # half a header
    torn_state = inspect(directory)
    assert torn_state.log_end_offset == 80 and last.name in torn_state.tail_detail
    assert last.stat().st_size == size + 11  # read only: nothing cut
    (directory / DATA_LOSS_FILE).write_bytes(encode_data_loss(DataLoss(
        str(directory / DATA_LOSS_FILE), 0, 0, "lost", 1)))
    assert inspect(directory).data_loss_detail == "lost"
    os.unlink(directory / DATA_LOSS_FILE)
