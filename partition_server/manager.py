"""All partitions of one server: which it owns (from ZooKeeper), their owners, and the
periodic chores (producer expiry, retention)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from partition_server import metrics as m
from partition_server.assignments import Assignments
from partition_server.owner import OwnerSettings, PartitionOwner
from services.errors import AtomlogError

log = logging.getLogger("atomlog.partition.manager")

OPEN_CONCURRENCY = 4  # partitions recovering at once at start-up
CHORE_INTERVAL_S = 30.0
# Topic settings (CreateTopic config) that override the server's storage defaults.
# cleanup.policy=compact needs nothing here: see docs/record-format.md on compaction.
TOPIC_LOG_SETTINGS = {"segment.bytes": "segment_bytes", "segment.ms": "segment_ms",
                      "retention.bytes": "retention_bytes", "retention.ms": "retention_ms"}


class NotOwner(Exception):
    def __init__(self, owner: str | None):
        self.owner = owner


class PartitionManager:
    def __init__(self, data_dir: Path, server_name: str, zk, settings: OwnerSettings,
                 coordinator_epochs=None):
        self.data_dir = data_dir
        self.coordinator_epochs = coordinator_epochs
        self.server_name = server_name
        self.zk = zk
        self.settings = settings
        self.owners: dict[tuple[str, int], PartitionOwner] = {}
        m.register_state_collector(lambda: self.owners.values())
        self.assignments: Assignments | None = None
        self._opening: set[tuple[str, int]] = set()
        self._semaphore = asyncio.Semaphore(OPEN_CONCURRENCY)
        self._tasks: set[asyncio.Task] = set()
        self._chores: asyncio.Task | None = None

    async def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        self.assignments = Assignments(self.zk, self.server_name, loop, self._reconcile)
        await asyncio.to_thread(self.assignments.start)
        await self.assignments.ready.wait()
        await asyncio.gather(*list(self._tasks))
        self._chores = asyncio.create_task(self._run_chores(), name="partition chores")

    def _reconcile(self) -> None:
        """Open every newly owned partition (in the background)."""
        for key in self.assignments.owned():
            if key in self.owners or key in self._opening:
                continue
            self._opening.add(key)
            task = asyncio.create_task(self._open(*key), name=f"open {key[0]}-{key[1]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _settings_for(self, topic: str) -> OwnerSettings:
        """Server defaults, overridden by the topic's own settings (CreateTopic config)."""
        record = self.assignments.topic(topic) if self.assignments else None
        overrides = {field: int(record.config[key]) for key, field in TOPIC_LOG_SETTINGS.items()
                     if record is not None and key in record.config}
        if not overrides:
            return self.settings
        return dataclasses.replace(self.settings,
                                   log=dataclasses.replace(self.settings.log, **overrides))

    async def _open(self, topic: str, partition: int) -> None:
        owner = PartitionOwner(topic, partition, self.data_dir / f"{topic}-{partition}",
                               self._settings_for(topic))
        self.owners[(topic, partition)] = owner  # visible as LOADING meanwhile
        if self.coordinator_epochs is not None:
            # Markers this partition wrote are durable in its log: their epochs fence
            # deposed coordinators even if ZooKeeper's /tc/<k> lags. Learned whenever its
            # transaction buffer is ready (at start, or after a background replay).
            epochs = self.coordinator_epochs

            def observe(txns) -> None:
                for tc, epoch in txns.coordinator_epochs().items():
                    epochs.observe(tc, epoch)

            owner.on_txns_ready = observe
        try:
            async with self._semaphore:
                await owner.start()
        except Exception:  # noqa: BLE001 — the partition stays LOADING-failed; logged
            log.exception("cannot open partition %s-%s", topic, partition)
        finally:
            self._opening.discard((topic, partition))

    def owner(self, topic: str, partition: int) -> PartitionOwner:
        """The owner of a partition hosted here; raise NotOwner / UNKNOWN_TOPIC_OR_PARTITION."""
        found = self.owners.get((topic, partition))
        if found is not None:
            return found
        owner_name = self.assignments.owner_of(topic, partition) if self.assignments else None
        if owner_name is None:
            record = self.assignments.topic(topic) if self.assignments else None
            detail = (f"topic {topic!r} has {record.partitions} partitions" if record
                      else f"unknown topic {topic!r}")
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                               f"no partition {topic}-{partition}: {detail}",
                               {"topic": topic, "partition": str(partition)})
        if owner_name == self.server_name:  # assigned here, still being opened
            raise AtomlogError("PARTITION_LOADING", f"partition {topic}-{partition} is opening",
                               {"retry_after_ms": "100"})
        raise NotOwner(owner_name)

    async def _run_chores(self) -> None:
        while True:
            await asyncio.sleep(CHORE_INTERVAL_S)
            for owner in list(self.owners.values()):
                try:
                    owner.expire_producers()
                    await owner.apply_retention()
                except Exception:  # noqa: BLE001 — logged, retried next round
                    log.exception("chores failed on %s", owner.name)

    async def close(self) -> None:
        if self._chores is not None:
            self._chores.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(o.close() for o in self.owners.values()), return_exceptions=True)
