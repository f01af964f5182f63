"""A replica's leader-epoch file (docs/replication.md, "Truncation by leader epoch"): the
`replication.LeaderEpochCache` of one partition directory, kept in `leader-epochs` and
rewritten durably (snapshot_files.write_atomically) at every change.

The log and this file change in separate steps, so after a crash the file may name epochs
that began past the log's end (the log was cut back, the file not yet) or before its start
(retention deleted segments): opening drops the first and moves the second to the log
start. An unreadable file is set aside (`leader-epochs.corrupt-<ms>`) and the replica
starts with no epochs: it then asks its leader about no epoch and refetches from the
leader's log start, which is slow but never keeps records outside the leader's history.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from partition_server.replication import LeaderEpochCache
from partition_server.snapshot_files import write_atomically
from services.logs import event

log = logging.getLogger("atomlog.partition.epochs")

FILE_NAME = "leader-epochs"


class LeaderEpochFile:
    def __init__(self, directory: str | os.PathLike, log_start: int, log_end: int):
        self.path = Path(directory) / FILE_NAME
        self.set_aside: Path | None = None  # where an unreadable file went
        self.cache = self._read()
        before = list(self.cache.entries)
        self.cache.entries = [(e, s) for e, s in self.cache.entries if s <= log_end]
        self.cache.truncate_from_start(log_start)
        if self.cache.entries != before:
            self._save()

    def _read(self) -> LeaderEpochCache:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return LeaderEpochCache()
        try:
            return LeaderEpochCache.decode(data)
        except ValueError as error:
            self.set_aside = self.path.with_name(f"{FILE_NAME}.corrupt-{int(time.time() * 1000)}")
            os.replace(self.path, self.set_aside)
            event(log, "unreadable leader-epoch file set aside", logging.WARNING,
                  path=str(self.path), moved_to=str(self.set_aside), error=str(error))
            return LeaderEpochCache()

    def assign(self, epoch: int, start: int) -> None:
        """A leader begins `epoch` at `start` (its log end), or a follower copies records
        of it from `start`. Durable when it returns."""
        before = list(self.cache.entries)
        self.cache.assign(epoch, start)
        if self.cache.entries != before:
            self._save()

    def truncate_from_end(self, end: int) -> None:
        """The log was cut back to `end`."""
        before = len(self.cache.entries)
        self.cache.truncate_from_end(end)
        if len(self.cache.entries) != before:
            self._save()

    def truncate_from_start(self, log_start: int) -> None:
        """Offsets below `log_start` are gone (retention, DeleteRecords, restart_at)."""
        before = list(self.cache.entries)
        self.cache.truncate_from_start(log_start)
        if self.cache.entries != before:
            self._save()

    def clear(self) -> None:
        """The log was emptied (a follower's restart at its leader's log start): it
        holds no record, so no epoch. (An epoch kept to label the empty log would be
        asked about, and a leader that no longer keeps it would answer NO_EPOCH for
        ever.)"""
        if self.cache.entries:
            self.cache.entries = []
            self._save()

    def _save(self) -> None:
        write_atomically(self.path, self.cache.encode())
