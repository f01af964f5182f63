"""The current coordinator epoch of every TC partition, as this partition server knows it:
what fences transaction markers (EndTxnOnPartition) from deposed coordinators.

A coordinator that takes TC partition k bumps the epoch in the persistent znode `/tc/<k>`
(JSON `{"epoch": E, "log_producer_id": P, ...}`) before it sends any marker. This server
watches those znodes (a kazoo ChildrenWatch on /tc learns new k, a DataWatch per k reads
its epoch; a missing znode means epoch 0) and keeps, per k,

    current(k) = max(highest epoch seen in ZooKeeper, highest epoch of an accepted marker)

A marker with an epoch below current(k) is stale and never applied. One with a higher
epoch is accepted — the watch may lag the coordinator's bump — and raises current(k)
(`observe`). Epochs only go up: a deleted or rewritten znode never lowers one.

Not durable yet: after a restart the epochs come back from ZooKeeper only. The transaction
buffer (next issue) stores the highest marker epoch per TC partition with its snapshot.

Kazoo calls the watches on its own thread and the servicer reads on the event loop, so
the table is behind a lock held only for a dictionary update (never across I/O).
"""

from __future__ import annotations

import json
import logging
import threading

from services.fastmetrics import Counter
from services.logs import event
from services.zk import TC_PATH, ZkSession

log = logging.getLogger("atomlog.partition.coordinator_epochs")

# Marker metrics (labels bounded: decision is commit|abort|invalid).
MARKERS = Counter("atomlog_partition_markers_total",
                  "Transaction markers handled, one per marker and target partition or "
                  "subscription: applied, refused as stale (coordinator epoch), or another "
                  "error (invalid marker, not the owner, unknown topic, not serving).",
                  ["decision", "result"])
STALE_MARKERS = Counter("atomlog_partition_stale_markers_total",
                        "Transaction markers refused because their coordinator epoch is below "
                        "the TC partition's current one (a deposed coordinator still sending).")


class CoordinatorEpochs:
    """Current coordinator epoch per TC partition 0..tc_partitions-1 (see module doc)."""

    def __init__(self, zk: ZkSession | None, tc_partitions: int):
        if tc_partitions < 1:
            raise ValueError("tc_partitions must be positive")
        self.zk = zk
        self.tc_partitions = tc_partitions
        self._lock = threading.Lock()
        self._epochs: dict[int, int] = {}  # at most tc_partitions entries
        self._watched: set[int] = set()  # only touched on kazoo's watch thread and in start

    def start(self) -> None:
        """Watch /tc (blocking: call it on a worker thread). kazoo reads the children and
        the data of each existing /tc/<k> before returning, so the epochs already in
        ZooKeeper are known before any marker is answered."""
        if self.zk is not None:
            self.zk.watch_children(f"watching {TC_PATH}", TC_PATH, self._on_children)

    def current(self, tc_partition: int) -> int:
        """The highest epoch known for the TC partition; 0 when none is known."""
        with self._lock:
            return self._epochs.get(tc_partition, 0)

    def observe(self, tc_partition: int, epoch: int) -> int:
        """Raise the TC partition's epoch to `epoch` if that is higher (an accepted marker,
        or ZooKeeper); return the epoch now current."""
        with self._lock:
            current = max(self._epochs.get(tc_partition, 0), epoch)
            self._epochs[tc_partition] = current
            return current

    def snapshot(self) -> dict[int, int]:
        """Every known epoch (TC partitions at epoch 0 are left out)."""
        with self._lock:
            return {k: e for k, e in self._epochs.items() if e > 0}

    # ------------------------------------------------------------------ kazoo callbacks
    def _on_children(self, names: list[str]) -> None:
        for name in names:
            if not name.isdigit() or int(name) >= self.tc_partitions:
                continue  # not a TC partition of this cluster
            k = int(name)
            if k in self._watched:
                continue
            self._watched.add(k)
            # A DataWatch stays on its path for good (across deletion and re-creation, and
            # across sessions), so one per k is enough.
            self.zk.client.DataWatch(f"{TC_PATH}/{k}", self._data_watcher(k))

    def _data_watcher(self, k: int):
        def on_data(data: bytes | None, stat, event_=None) -> None:
            # Never raise: kazoo retries a callback that raises TypeError with fewer args.
            try:
                self._on_data(k, data)
            except Exception:  # noqa: BLE001 — logged; the next change is read again
                log.exception("cannot read %s/%s", TC_PATH, k)

        return on_data

    def _on_data(self, k: int, data: bytes | None) -> None:
        if not data:
            return  # no znode (yet), or an empty one: nothing learned, nothing lowered
        try:
            epoch = json.loads(data)["epoch"]
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
        except (ValueError, KeyError, TypeError) as error:
            # Keep what is known: markers are still fenced at the last readable epoch.
            event(log, "unreadable TC partition record; keeping the known epoch",
                  logging.WARNING, tc_partition=k, error=str(error), known=self.current(k))
            return
        before = self.current(k)
        now = self.observe(k, epoch)
        if now != before:
            event(log, "coordinator epoch", tc_partition=k, epoch=now)
