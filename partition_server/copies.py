"""Which unreplicated partitions a server holds the only copy of, recorded in ZooKeeper
(docs/operations.md, AtomlogPartitionDataLoss: "a partition's only copy lost").

A partition of a topic created with one copy (no replication state) lives in one
directory on one server, and nothing else knew it existed. A server that started
without that directory (a wiped or replaced disk, an empty volume, a deleted directory)
made a new, empty partition at offset 0 and served it: every record was gone, producers
and readers saw offsets they had used before, and no one was told. A `__txn_log-<k>`
partition lost that way also forgot every transaction its coordinator had decided.

So before such a partition first serves, its server records `/copies/<topic>/<p>`:
the server's name and the topic's creation time (a topic made again under the same name
is a new topic, whose partitions are new). The directory is made first (and fsynced in
its parent), then the record, then the partition serves. So a record always means the
directory existed, and a partition that ever acknowledged a write has its record. A
server that finds the record and no directory knows the copy is lost: the partition
opens in DATA_LOSS instead of empty (the manager's `_mark_lost`), and an operator accepts
the loss with `atomlog partition recover` (it then starts empty, its record kept).

The calls are synchronous kazoo calls (callers on an event loop run them on a thread);
`verdict` is the pure rule. `inspect` reads what a copy (of any partition, replicated or
not) holds on disk, for an operator choosing which replica leads an offline partition.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kazoo.exceptions import NodeExistsError, NoNodeError

from partition_server import segment as seg_mod
from partition_server.leader_epochs import FILE_NAME as EPOCHS_FILE
from partition_server.log import read_data_loss_marker
from partition_server.replication import LeaderEpochCache

COPIES_PATH = "/copies"


class Verdict(Enum):
    OPEN = "open"  # the directory is there and recorded
    RECORD = "record"  # a new copy (or one recorded before this rule): record it, then open
    LOST = "lost"  # recorded as this server's, and its directory is gone


def path_of(topic: str, partition: int) -> str:
    return f"{COPIES_PATH}/{topic}/{partition}"


def verdict(directory_exists: bool, record: dict | None, server: str,
            topic_created_unix_ms: int) -> Verdict:
    """What a server does with an unreplicated partition assigned to it, from whether its
    directory exists and the copy's record (None: none). A record of another server, or of
    an earlier topic of the same name, does not count: the copy is this server's to make."""
    recorded = (record is not None and record.get("server") == server
                and record.get("topic_created_unix_ms") == topic_created_unix_ms)
    if directory_exists:
        return Verdict.OPEN if recorded else Verdict.RECORD
    return Verdict.LOST if recorded else Verdict.RECORD


def read(client, topic: str, partition: int) -> dict | None:
    """The copy's record, or None when there is none (or it is unreadable: written again)."""
    try:
        data, _stat = client.get(path_of(topic, partition))
    except NoNodeError:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def record(client, topic: str, partition: int, server: str,
           topic_created_unix_ms: int) -> None:
    """Record that `server` holds the partition's copy (created, or overwritten when the
    record there is another's or unreadable)."""
    path = path_of(topic, partition)
    payload = json.dumps({"server": server, "topic_created_unix_ms": topic_created_unix_ms,
                          "recorded_unix_ms": int(time.time() * 1000)}).encode()
    try:
        client.create(path, payload, makepath=True)
    except NodeExistsError:
        client.set(path, payload)


def lost_detail(record: dict) -> str:
    """DATA_LOSS's detail for a lost copy."""
    when = record.get("recorded_unix_ms")
    since = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when / 1000))
             if isinstance(when, int) else "an earlier start")
    return (f"the partition's directory was missing when its server opened it (a wiped or "
            f"replaced disk, an empty volume, a deleted directory), though this server has "
            f"held its only copy since {since} (ZooKeeper {COPIES_PATH}): every record it "
            f"held is lost. `atomlog partition recover` with this file and offset 0 "
            f"accepts the loss and starts the partition empty at offset 0")


# ---------------------------------------------------------------------------------------
# What a copy holds on disk (PartitionService.DescribeCopy, `atomlog partition copies`)

@dataclass(frozen=True)
class CopyState:
    """A copy as its files show it, read without opening it (module `inspect`)."""

    present: bool
    log_start_offset: int = 0
    log_end_offset: int = 0
    tail_detail: str = ""  # why the read of the last segment stopped before its end
    latest_leader_epoch: int = -1
    latest_epoch_start_offset: int = -1
    segment_count: int = 0
    size_bytes: int = 0
    data_loss_detail: str = ""


def inspect(directory: Path) -> CopyState:
    """What the copy in `directory` holds: its segments' span, ending after the last whole
    batch of its last segment (every batch of it read and its CRC checked, 1 MiB at a
    time: what recovery would keep of it), and the last entry of its leader-epoch file.
    Reads only: a copy open meanwhile (a leader's, a follower's) is not disturbed, and
    what it shows is a moment of it. A copy whose last segment is empty or torn from its
    first batch ends where that segment begins."""
    if not directory.is_dir():
        return CopyState(present=False)
    bases, size = [], 0
    with os.scandir(directory) as entries:
        for entry in entries:
            base = seg_mod.parse_segment_name(entry.name)
            if base is not None:
                bases.append(base)
                try:
                    size += entry.stat().st_size
                except FileNotFoundError:
                    pass  # deleted meanwhile (retention)
    bases.sort()
    marker = read_data_loss_marker(directory)
    loss = (marker.detail or "(no detail)") if marker is not None else ""
    epoch, epoch_start = -1, -1
    try:
        entries = LeaderEpochCache.decode((directory / EPOCHS_FILE).read_bytes()).entries
        if entries:
            epoch, epoch_start = entries[-1]
    except (FileNotFoundError, ValueError):
        pass
    if not bases:
        return CopyState(True, latest_leader_epoch=epoch, latest_epoch_start_offset=epoch_start,
                         data_loss_detail=loss)
    last = seg_mod.Segment(directory, bases[-1]).log_path
    end, detail = bases[-1], ""
    try:
        fd = os.open(last, os.O_RDONLY)
    except FileNotFoundError:
        detail = "its last segment went while it was read"
    else:
        try:
            result = seg_mod.scan(fd, 0, os.fstat(fd).st_size, bases[-1])
        finally:
            os.close(fd)
        end = result.next_offset
        if result.failure is not None:
            detail = (f"{last.name} at position {result.failure.position}: "
                      f"{result.failure.detail}")
    return CopyState(True, bases[0], end, detail, epoch, epoch_start, len(bases), size, loss)
