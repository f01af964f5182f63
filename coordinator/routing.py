"""Where a coordinator's calls to partition servers go: topic partition -> owner address,
from ZooKeeper (the MetadataStore), cached and refreshed when a server says it moved or
cannot be reached; one grpc.aio channel per address."""

from __future__ import annotations

import asyncio
import time

from atomlog.v1 import partition_pb2, partition_pb2_grpc

from services import local
from services.errors import AtomlogError

PARTITION_SERVICE = partition_pb2.DESCRIPTOR.services_by_name["PartitionService"].full_name

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
MIN_REFRESH_INTERVAL_S = 0.1  # bounds refresh storms after many routing errors


class PartitionRoutes:
    """Owner addresses of topic partitions, shared by every TC partition of a process."""

    def __init__(self, metadata_store):
        self.store = metadata_store
        self._owners: dict[str, list[str]] = {}  # topic -> owner address per partition
        self._refreshed_at = 0.0
        self._read_began = 0.0
        self._lock = asyncio.Lock()
        self._stubs = local.StubCache(PARTITION_SERVICE,
                                      partition_pb2_grpc.PartitionServiceStub, CHANNEL_OPTIONS)

    async def refresh(self, *, force: bool = False, fresh: bool = False) -> None:
        """Re-read owners from ZooKeeper — at most every MIN_REFRESH_INTERVAL_S unless
        `force`; `fresh` waits out that interval instead of skipping the read, so the
        answer is newer than the call (a topic created just before is seen)."""
        called = time.monotonic()
        async with self._lock:
            if self._read_began > called:
                return  # a read that began after this call has finished meanwhile
            wait = MIN_REFRESH_INTERVAL_S - (time.monotonic() - self._refreshed_at)
            if not force and wait > 0:
                if not fresh:
                    return
                await asyncio.sleep(wait)
            self._read_began = time.monotonic()
            servers = {s.name: s.grpc_address for s in await self.store.servers()}
            self._owners = {t.name: [servers.get(owner, "") for owner in t.owners]
                            for t in await self.store.topics()}
            self._refreshed_at = time.monotonic()

    async def partition_count(self, topic: str) -> int | None:
        """Partitions of a topic (None: unknown), refreshing once when it is not cached."""
        if topic not in self._owners:
            await self.refresh(fresh=True)
        owners = self._owners.get(topic)
        return None if owners is None else len(owners)

    def cached_owner(self, topic: str, partition: int) -> str:
        """The owner's address as cached ("" when unknown or down)."""
        owners = self._owners.get(topic)
        if owners is None or not 0 <= partition < len(owners):
            return ""
        return owners[partition]

    async def owner(self, topic: str, partition: int) -> str:
        address = self.cached_owner(topic, partition)
        if not address:
            await self.refresh()
            address = self.cached_owner(topic, partition)
        if not address:
            raise AtomlogError("SERVER_UNAVAILABLE",
                               f"no live partition server owns {topic}/{partition}",
                               {"retry_after_ms": "500"})
        return address

    def stub(self, address: str) -> partition_pb2_grpc.PartitionServiceStub:
        """One channel and one stub per address; in-process where this process owns it."""
        return self._stubs.get(address)

    async def close(self) -> None:
        await self._stubs.close()
