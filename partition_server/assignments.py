"""Which partitions this server owns, kept current from ZooKeeper.

A kazoo ChildrenWatch on /topics reads every new topic's record (topic records are
written once, whole, at creation). The callback runs on kazoo's thread and hands the
new table to the event loop, where `on_change` opens newly owned partitions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable

from kazoo.exceptions import NoNodeError

from services.logs import event
from services.topics import TopicRecord
from services.zk import TOPICS_PATH, ZkSession

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
        self.ready = asyncio.Event()

    def start(self) -> None:
        self.zk.client.ChildrenWatch(TOPICS_PATH, self._on_children)

    def _on_children(self, names: list[str]) -> None:
        known = dict(self._topics)
        fresh: dict[str, TopicRecord] = {}
        for name in names:
            if name in known:
                fresh[name] = known[name]
                continue
            try:
                data, _ = self.zk.client.get(f"{TOPICS_PATH}/{name}")
                fresh[name] = TopicRecord.from_json(name, json.loads(data))
            except NoNodeError:
                continue
            except ValueError:
                log.exception("unreadable topic record %s", name)
        with self._lock:
            self._topics = fresh
        event(log, "assignments updated", topics=len(fresh), owned=len(self.owned()))
        self.loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        self.ready.set()
        self.on_change()

    def owned(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(topic.name, index) for topic in self._topics.values()
                    for index, owner in enumerate(topic.assignment) if owner == self.server_name]

    def owner_of(self, topic: str, partition: int) -> str | None:
        """Name of the owning server, or None when the topic or partition is unknown."""
        with self._lock:
            record = self._topics.get(topic)
        if record is None or not 0 <= partition < record.partitions:
            return None
        return record.assignment[partition]

    def topic(self, name: str) -> TopicRecord | None:
        with self._lock:
            return self._topics.get(name)
