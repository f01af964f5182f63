"""Failpoints: operations that fail on demand inside a real server process, for the
fault-injection harness (tests/chaos).

Off unless the environment variable ATOMLOG_FAILPOINTS names a directory when the
process starts (the harness sets it for each process it launches; nothing else does).
Then each failpoint is armed while a file of its name exists in that directory, so the
harness arms and disarms it from outside without talking to the process:

    fsync    every fsync of a partition log or cursor journal raises EIO, as a failing
             disk does. The server's own handling is what is under test: the partition
             fails closed, answers PARTITION_LOADING, and reloads from its durable log.
    recovery_point_write
             every write of a partition log's recovery point raises ENOSPC, as on a full
             disk (whose preallocated write-ahead segments still take rounds): the
             partition fails closed and reloads, and its reload retries until disarmed.
             A number in the file: the milliseconds each write first takes (at most
             1,000), as on a slow disk, so a test can have it fail while the next
             write-ahead round is under way.
    fsync_slow
             every fsync (and syncfs round) first sleeps the milliseconds written in the
             file (5 when it is empty), as a slow or network-attached disk does: for
             benchmarks that ask what a durability round costs (bench/transactions.py
             --fsync-delay-ms).
    one_call_decide
             a coordinator holds every one-call transaction between its staging and its
             decision (CommitTxn), so a test can kill it exactly there.
    one_call_stage
             a coordinator holds every one-call transaction's staging before it sends
             anything (a parallel commit's Staging record is appended meanwhile), so a
             test can kill or pause it with the record durable and nothing staged.
    markers_send
             a coordinator holds every marker call (EndTxnOnPartition) before sending it,
             and lets no marker ride with a staging call (StageTxn) meanwhile, so a test
             can kill a partition server between a decision and its markers.
    stage_appends_unknown
             a partition server answers StageTxn as one from before
             StageTxnRequest.appends: it ignores riding TC-log appends (and refuses a
             call that has nothing else), so a test can see a coordinator send them by
             Produce instead (a rolling upgrade's mixed versions).
    verify_hold
             a partition server holds every verification call (VerifyTxnPartitions)
             before sending it, so a test can send more batches while a transaction's
             first batch waits for its verification.
    hand_over_hold
             a partition server holds every hand-over of a damaged partition
             (LeaderReplication.hand_over) before it writes the new leadership, so a
             test can see what the damaged leader answers meanwhile.
    start_zookeeper_loss
             once: the next server to start meets a lost ZooKeeper connection
             (kazoo's ConnectionLoss) in a step of its start-up, as a blip does, and the
             file is removed, so the start after it goes through.
    steer_zookeeper_loss
             while armed, a partition server that looks a new leader's addresses up for
             a follower it steers meets a lost ZooKeeper connection (ConnectionLoss), as
             during a blip, so a test can see the steering outlast it.
    follower_fetch_hold
             a partition server's followers ask their leaders for nothing (each
             leader's next ReplicateMany waits), so a test can keep a restarted server
             out of the ISRs it would rejoin and see what it reports meanwhile.

Off, a failpoint costs a function call and one comparison with None.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time

ENVIRONMENT_VARIABLE = "ATOMLOG_FAILPOINTS"
FSYNC = "fsync"
FSYNC_SLOW = "fsync_slow"
RECOVERY_POINT_WRITE = "recovery_point_write"
FSYNC_SLOW_DEFAULT_MS = 5.0
ONE_CALL_DECIDE = "one_call_decide"
ONE_CALL_STAGE = "one_call_stage"
MARKERS_SEND = "markers_send"
VERIFY_HOLD = "verify_hold"
STAGE_APPENDS_UNKNOWN = "stage_appends_unknown"
HAND_OVER_HOLD = "hand_over_hold"
START_ZOOKEEPER_LOSS = "start_zookeeper_loss"
STEER_ZOOKEEPER_LOSS = "steer_zookeeper_loss"
FOLLOWER_FETCH_HOLD = "follower_fetch_hold"

_DIRECTORY: str | None = os.environ.get(ENVIRONMENT_VARIABLE) or None


def armed(name: str) -> bool:
    return _DIRECTORY is not None and os.path.exists(os.path.join(_DIRECTORY, name))


def take(name: str) -> bool:
    """A one-shot failpoint: whether it was armed, disarming it (its file removed; of
    processes racing for it, one gets it)."""
    if _DIRECTORY is None:
        return False
    try:
        os.unlink(os.path.join(_DIRECTORY, name))
    except FileNotFoundError:
        return False
    return True


def fsync(fd: int) -> None:
    """os.fsync, unless the fsync failpoint is armed: then OSError(EIO), nothing synced.
    With fsync_slow armed, it first sleeps (before_sync)."""
    before_sync("fsync")
    os.fsync(fd)


def before_sync(call: str) -> None:
    """What a disk sync on a thread (`call`: fsync, syncfs) meets before its
    system call: OSError(EIO) while the fsync failpoint is armed (nothing synced), a slow
    disk's sleep while fsync_slow is."""
    refused = sync_refusal(call)
    if refused is not None:
        raise refused
    delay_s = slow_disk_seconds()
    if delay_s:  # on sync threads: an event loop waits it with call_later instead
        time.sleep(delay_s)


def sync_refusal(call: str) -> OSError | None:
    """The OSError(EIO) a disk sync (`call`) fails with while the fsync failpoint is
    armed, else None (an event loop's io_uring checks it without sleeping)."""
    if armed(FSYNC):
        return OSError(errno.EIO, f"{call} failed (fsync failpoint armed by the fault harness)")
    return None


def slow_disk_seconds() -> float:
    """How long a sync waits first while fsync_slow is armed (its file holds the
    milliseconds; empty or unreadable: FSYNC_SLOW_DEFAULT_MS; at most 1 s); 0 when not
    armed. An event loop waits it with call_later instead of sleeping."""
    return armed_seconds(FSYNC_SLOW, FSYNC_SLOW_DEFAULT_MS) or 0.0


def armed_seconds(name: str, default_ms: float) -> float | None:
    """The seconds written (as milliseconds) in the file of the failpoint `name`
    (empty or unreadable: `default_ms`; at most 1 s), or None when it is not armed."""
    if _DIRECTORY is None:
        return None
    try:
        with open(os.path.join(_DIRECTORY, name)) as armed_file:
            text = armed_file.read().strip()
    except OSError:
        return None  # not armed
    try:
        delay_ms = float(text) if text else default_ms
    except ValueError:
        delay_ms = default_ms
    return max(0.0, min(delay_ms, 1_000.0)) / 1000


def recovery_point_refusal() -> OSError | None:
    """The OSError(ENOSPC) a recovery-point write fails with while recovery_point_write
    is armed, after first waiting the milliseconds its file holds (none when it is
    empty), else None."""
    delay_s = armed_seconds(RECOVERY_POINT_WRITE, 0.0)
    if delay_s is None:
        return None
    if delay_s:
        time.sleep(delay_s)
    return OSError(errno.ENOSPC, "failpoint recovery_point_write: no space left")


async def hold(name: str) -> None:
    """Wait while the failpoint `name` is armed (at once when failpoints are off)."""
    while armed(name):
        await asyncio.sleep(0.02)
