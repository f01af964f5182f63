"""Which partitions this server owns, kept current from ZooKeeper.

A kazoo ChildrenWatch on /topics finds every new topic, and a DataWatch on its record
keeps it current (a record is written whole at creation, and again when its settings
change (AlterTopicConfig) or a partition's reassignment begins or ends). The callbacks run on kazoo's thread and hand the change
to the event loop, where `on_change` opens newly owned partitions.

Replicated topics (docs/replication.md): for every partition this server holds a replica
of, a DataWatch keeps its state (leader, epoch, ISR) with the znode version, and a
ChildrenWatch on /servers keeps the set of live servers; any change calls `on_change`,
where the manager steers each replica to leader, follower or an election.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable

from partition_server.partition_states import Versioned, path_of
from partition_server.replication import PartitionState
from services.logs import event
from services.topics import TopicRecord
from services.zk import SERVERS_PATH, TOPICS_PATH, ZkSession

log = logging.getLogger("atomlog.partition.assignments")


class Assignments:
    def __init__(self, zk: ZkSession, server_name: str, loop: asyncio.AbstractEventLoop,
                 on_change: Callable[[], None]):
        self.zk = zk
        self.server_name = server_name
        self.loop = loop
        self.on_change = on_change
        self._lock = threading.Lock()
        self._topics: dict[str, TopicRecord] = {}
        self._states: dict[tuple[str, int], Versioned] = {}
        self._watched: set[tuple[str, int]] = set()
        self._record_watches: set[str] = set()
        self._live: set[str] = set()
        self.ready = asyncio.Event()

    def start(self) -> None:
        self.zk.watch_children(f"watching {SERVERS_PATH}", SERVERS_PATH, self._on_servers)
        self.zk.watch_children(f"watching {TOPICS_PATH}", TOPICS_PATH, self._on_children)

    def _on_servers(self, names: list[str]) -> None:
        with self._lock:
            self._live = set(names)
        if self.ready.is_set() or self._topics:
            self.loop.call_soon_threadsafe(self._notify)

    def _watch_states(self, record: TopicRecord) -> None:
        """DataWatch the state of each partition of `record` with a replica here."""
        for partition in range(record.partitions):
            key = (record.name, partition)
            if self.server_name not in record.replicas_of(partition) or key in self._watched:
                continue
            self._watched.add(key)
            self.zk.client.DataWatch(path_of(*key), self._state_watcher(key))

    def _state_watcher(self, key: tuple[str, int]):
        # Exactly (data, stat): kazoo passes a third argument to functions that take one.
        # (Not checked against the replicas known here: a reassignment may add an in-sync
        # replica that this server's copy of the topic record does not list yet.)
        def on_data(data, stat) -> None:
            if data is None:
                with self._lock:
                    self._states.pop(key, None)
            else:
                try:
                    state = PartitionState.from_json(data)
                except ValueError:
                    log.exception("unreadable partition state %s", path_of(*key))
                    return
                with self._lock:
                    self._states[key] = Versioned(state, stat.version)
            self.loop.call_soon_threadsafe(self._notify)
        return on_data

    def _on_children(self, names: list[str]) -> None:
        """Topics come and go: each new one gets a DataWatch on its record (a record
        changes when a partition's reassignment begins or ends)."""
        with self._lock:
            gone = set(self._topics) - set(names)
            for name in gone:
                del self._topics[name]
        for name in names:
            if name not in self._record_watches:
                self._record_watches.add(name)
                # Calls back at once (on this thread) with the record as it is now.
                self.zk.client.DataWatch(f"{TOPICS_PATH}/{name}", self._record_watcher(name))
        event(log, "assignments updated", topics=len(self._topics), owned=len(self.owned()))
        self.loop.call_soon_threadsafe(self._notify)

    def _record_watcher(self, name: str):
        def on_data(data, stat) -> None:
            if data is None:
                with self._lock:
                    self._topics.pop(name, None)
                return
            try:
                record = TopicRecord.from_json(name, json.loads(data))
            except ValueError:
                log.exception("unreadable topic record %s", name)
                return
            with self._lock:
                known = self._topics.get(name)
                self._topics[name] = record
            if record.replicated:
                self._watch_states(record)
            if known is not None and known != record:
                event(log, "topic record changed", topic=name,
                      reassigning={str(p): t for p, t in record.reassigning.items()})
                self.loop.call_soon_threadsafe(self._notify)
        return on_data

    def _notify(self) -> None:
        self.ready.set()
        self.on_change()

    def owned(self) -> list[tuple[str, int]]:
        """Partitions of unreplicated topics assigned here."""
        with self._lock:
            return [(topic.name, index) for topic in self._topics.values()
                    if not topic.replicated
                    for index, owner in enumerate(topic.assignment) if owner == self.server_name]

    def replicated_here(self) -> list[tuple[str, int]]:
        """Partitions of replicated topics with a replica here."""
        with self._lock:
            return [(topic.name, index) for topic in self._topics.values() if topic.replicated
                    for index in range(topic.partitions)
                    if self.server_name in topic.replicas[index]]

    def state(self, key: tuple[str, int]) -> Versioned | None:
        with self._lock:
            return self._states.get(key)

    def live(self) -> set[str]:
        with self._lock:
            return set(self._live)

    def owner_of(self, topic: str, partition: int) -> str | None:
        """Name of the owning server (a replicated partition: its leader, "" when offline or
        its state is not known yet), or None when the topic or partition is unknown."""
        with self._lock:
            record = self._topics.get(topic)
            state = self._states.get((topic, partition))
        if record is None or not 0 <= partition < record.partitions:
            return None
        if record.replicated:
            return (state.state.leader or "") if state is not None else ""
        return record.assignment[partition]

    def topic(self, name: str) -> TopicRecord | None:
        with self._lock:
            return self._topics.get(name)
