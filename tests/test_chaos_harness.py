"""Unit tests of the chaos harness's own parts that are not the checker
(tests/test_chaos_checker.py): the fault schedule's restart and power nemeses, the power
nemesis's disks (real loop devices and ext4, as root), and how the runner tells a server's
exit that is a problem of the run from one that is not."""

from __future__ import annotations

import json
import os
import random
import shutil
from types import SimpleNamespace

import pytest

from tests.chaos import disks, nemesis
from tests.chaos.runner import Run

TOPOLOGY = nemesis.Topology(("ps-0", "ps-1", "ps-2"), ("coord-0", "coord-1"), ("ida-0",),
                            session_timeout_s=3.0)


def test_restart_faults_are_spaced_by_their_whole_span_and_cut_zookeeper_past_the_session():
    for seed in range(40):
        faults = nemesis.schedule(seed, ["restart", "kill"], 120, TOPOLOGY)
        assert faults
        for before, after in zip(faults, faults[1:]):
            assert after.at_s >= before.at_s + before.span_s + nemesis.QUIET_S[0]
        for fault in faults:
            assert fault.at_s + fault.span_s <= 120
            if fault.fault == "restart-zk-blip":
                assert fault.target in TOPOLOGY.servers
                assert 0 <= fault.down_s <= 2 and 0 <= fault.delay_s <= 3
                assert fault.duration_s > TOPOLOGY.session_timeout_s
                assert fault.span_s == fault.down_s + fault.delay_s + fault.duration_s
            else:
                assert fault.span_s == fault.duration_s


def test_a_seed_without_the_restart_nemesis_schedules_what_it_did_before_it():
    # The restart nemesis's fields are zero elsewhere: older faults' spans are their
    # durations, so a seed replays an older run's schedule when its nemeses are named.
    faults = nemesis.schedule(295, ["kill", "pause", "net", "disk"], 36, TOPOLOGY)
    assert all(f.down_s == 0 and f.span_s == f.duration_s for f in faults)


def test_power_faults_cut_one_partition_server_or_every_server():
    kinds = set()
    for seed in range(40):
        for fault in nemesis.schedule(seed, ["power"], 60, TOPOLOGY):
            kinds.add(fault.fault)
            assert 0 <= fault.duration_s <= 4 and fault.span_s == fault.duration_s
            if fault.fault == "power":
                assert fault.target in TOPOLOGY.partition_servers
            else:
                assert (fault.fault, fault.target) == ("power-all", "*")
    assert kinds == {"power", "power-all"}
    assert not any(f.fault.startswith("power")
                   for f in nemesis.schedule(7, ["kill", "net"], 120, TOPOLOGY))


def test_misplace_moves_one_partition_servers_copies_and_is_for_one_copy_runs_only():
    seen = set()
    for seed in range(20):
        for fault in nemesis.schedule(seed, ["misplace"], 60, TOPOLOGY):
            assert fault.fault == "misplace" and fault.target in TOPOLOGY.partition_servers
            assert 4 <= fault.duration_s <= 8 and 0 <= fault.down_s <= 2
            seen.add(fault.target)
    assert seen == set(TOPOLOGY.partition_servers)
    from tests.chaos.__main__ import parse

    assert "misplace" in parse(["--workload", "log"]).nemeses
    assert "misplace" not in parse(["--workload", "log", "--replication", "3"]).nemeses
    with pytest.raises(SystemExit):
        parse(["--workload", "log", "--replication", "3", "--nemesis", "misplace"])


def _write(path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.skipif(disks.available() is not None,
                    reason=f"power nemesis disks: {disks.available()}")
def test_a_power_cut_keeps_what_was_fsynced_and_loses_what_only_the_page_cache_held(tmp_path):
    images = disks.images_dir(f"test-{tmp_path.name}", tmp_path)
    disk = disks.LoopDisk(images / "d.img", tmp_path / "data", 64 << 20)
    disk.create()
    try:
        data = disk.mount
        _write(data / "log", b"a" * 5000, sync=True)   # durable: data and its name
        _write(data / "old", b"old", sync=True)
        _fsync_dir(data)
        _write(data / "log", b"b" * 5000, sync=False)  # an unsynced tail
        _write(data / "never-synced", b"d" * 100, sync=False)
        (data / "old.tmp").write_bytes(b"new")  # replaces "old" by a rename, no fsync
        os.replace(data / "old.tmp", data / "old")
        assert (data / "log").stat().st_size == 10_000  # the page cache holds it all
        assert (data / "old").read_bytes() == b"new"
        said = disk.cut()
        assert said == "clean" or said.startswith("e2fsck exit 1")  # (1: counts fixed)
        assert (data / "log").read_bytes() == b"a" * 5000
        # Unsynced data is gone. (Names are metadata: ext4's journal commits them every
        # 5 s, so one may have reached the disk without its data, as after a power cut.)
        assert not (data / "never-synced").exists() or \
            (data / "never-synced").read_bytes() == b""
        assert (data / "old").read_bytes() in (b"old", b"")
        # The disk is usable again, and the next cut starts from there.
        _write(data / "log", b"f" * 10, sync=True)
        disk.cut()
        assert (data / "log").read_bytes() == b"a" * 5000 + b"f" * 10
        # Cuts that may tear (even odds a file): part of a lost tail comes back, in
        # whole sectors, the last maybe zeros; one that does not tear loses it all.
        for name in ("old", "never-synced"):
            (data / name).unlink(missing_ok=True)
        _fsync_dir(data)
        durable = (data / "log").read_bytes()
        tears = 0
        for seed in range(12):
            _write(data / "log", b"g" * 3000, sync=False)
            said = disk.cut(tear=random.Random(seed))
            tail = (data / "log").read_bytes()[len(durable):]
            if said.endswith(", 1 torn"):
                tears += 1
                assert 0 < len(tail) <= 3000 and set(tail) <= {ord("g"), 0}, said
                assert tail.rstrip(b"\0") == b"g" * len(tail.rstrip(b"\0"))
                os.truncate(data / "log", len(durable))  # back to the durable part
                _write(data / "log", b"", sync=True)
            else:
                assert tail == b"" and "torn" not in said, said
        assert 0 < tears < 12
    finally:
        disk.remove()
        shutil.rmtree(images, ignore_errors=True)
    assert not disk.image.exists() and not disk.device


def test_a_torn_tail_is_a_prefix_of_what_the_cut_lost_in_whole_sectors(tmp_path):
    live, cut = tmp_path / "live", tmp_path / "cut"
    for root in (live, cut):
        (root / "d").mkdir(parents=True)
    kept = os.urandom(3000)
    lost = {f"d/f{i}": os.urandom(100 + 700 * i) for i in range(40)}
    for name, tail in lost.items():
        (live / name).write_bytes(kept + tail)
        (cut / name).write_bytes(kept)
    (live / "same").write_bytes(b"x" * 10)  # nothing lost: never touched
    (cut / "same").write_bytes(b"x" * 10)
    (cut / "only-after").write_bytes(b"y")  # not in the live filesystem
    (live / "longer-after").write_bytes(b"z")
    (cut / "longer-after").write_bytes(b"zz")
    torn = disks.tear_tails(live, cut, random.Random(5))
    shapes = set()
    for name, tail in lost.items():
        got = (cut / name).read_bytes()
        assert got[:len(kept)] == kept
        added = got[len(kept):]
        if not added:
            continue
        shapes.add("torn")
        # whole sectors of the lost tail (or all of it), the last one maybe zeros
        assert len(added) == len(tail) or len(added) % disks.SECTOR == 0
        last = (len(added) - 1) // disks.SECTOR * disks.SECTOR
        assert added[:last] == tail[:last]
        assert added[last:] in (tail[last:len(added)], bytes(len(added) - last))
        shapes.add("zeroed" if added[last:] != tail[last:len(added)] else "whole")
    assert torn == sum((cut / n).stat().st_size > len(kept) for n in lost)
    assert 5 < torn < 35 and shapes == {"torn", "zeroed", "whole"}
    assert (cut / "same").read_bytes() == b"x" * 10
    assert (cut / "only-after").read_bytes() == b"y"
    assert (cut / "longer-after").read_bytes() == b"zz"


def _event(msg: str, **fields) -> str:
    return json.dumps({"level": "ERROR", "logger": "atomlog.runtime", "msg": msg, **fields})


def _reason(tmp_path, lines: list[str], mark_lines: int = 0):
    log_file = tmp_path / "ps-0.log"
    log_file.write_text("".join(line + "\n" for line in lines))
    mark = len("".join(line + "\n" for line in lines[:mark_lines]))
    runner = SimpleNamespace(log_marks={"ps-0": mark})
    return Run.exit_reason(runner, SimpleNamespace(name="ps-0", log_file=str(log_file)))


def test_a_start_given_up_on_zookeeper_is_a_problem_of_the_run(tmp_path):
    said, problem = _reason(tmp_path, [
        _event("start"),
        _event("cannot start: ZooKeeper failed during start-up",
               error="RetryFailedError('Too many retry attempts')",
               at="partition_server/coordinator_epochs.py:62 in start")])
    assert problem and "coordinator_epochs.py:62" in said
    said, problem = _reason(tmp_path, [_event("cannot start", reason="ZOOKEEPER_UNAVAILABLE",
                                              error="no ZooKeeper within 30 s")])
    assert problem and "ZOOKEEPER_UNAVAILABLE" in said


def test_a_start_refused_for_another_reason_is_a_note_and_a_crash_is_a_problem(tmp_path):
    said, problem = _reason(tmp_path, [_event("cannot start", reason="STORAGE_ERROR",
                                              error="No space left on device")])
    assert not problem and "STORAGE_ERROR" in said
    said, problem = _reason(tmp_path, [_event("serving"), "Traceback (most recent call last):",
                                       "MemoryError"])
    assert problem and "no start-up failure logged" in said and "MemoryError" in said


def test_a_stop_for_a_failed_write_ahead_round_is_a_note_when_the_harness_failed_it(
        tmp_path):
    stop = "stopping: the write-ahead file failed under frames whose loss stops the server"
    said, problem = _reason(tmp_path, [_event("serving"), _event(
        stop, error="OSError(5, 'fsync failed (fsync failpoint armed by the fault harness)')",
        exit_status=74)])
    assert not problem and "fault harness" in said
    said, problem = _reason(tmp_path, [_event("serving"), _event(
        stop, error="OSError(5, 'Input/output error')", exit_status=74)])
    assert problem and "Input/output error" in said


def test_only_the_last_incarnations_lines_count(tmp_path):
    # An earlier incarnation gave up on ZooKeeper (already recorded then); this one crashed.
    said, problem = _reason(tmp_path, [
        _event("cannot start", reason="ZOOKEEPER_UNAVAILABLE"), _event("start"),
        _event("serving")], mark_lines=1)
    assert problem and "no start-up failure logged" in said
    said, problem = _reason(tmp_path, [
        _event("cannot start", reason="ZOOKEEPER_UNAVAILABLE"), _event("start"),
        _event("cannot start", reason="STORAGE_ERROR")], mark_lines=1)
    assert not problem and "STORAGE_ERROR" in said
