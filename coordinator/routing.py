"""Where a coordinator's calls to partition servers go: topic partition -> owner address,
from ZooKeeper (the MetadataStore), cached and refreshed when a server says it moved or
cannot be reached; one grpc.aio channel per address."""

from __future__ import annotations

import asyncio
import logging
import time

from atomlog.v1 import partition_pb2, partition_pb2_grpc

from partition_server.copy_link import CallLinks
from services import local
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.coordinator.routing")

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

    def __init__(self, metadata_store, use_links: bool = True):
        self.store = metadata_store
        self.use_links = use_links
        self._owners: dict[str, list[str]] = {}  # topic -> owner address per partition
        self._link_addresses: dict[str, str] = {}  # gRPC address -> its server's link
        # gRPC address -> the stub on its link; one that cannot be reached: the server
        # may have restarted with another link address.
        self._links = CallLinks("PartitionService", self.refresh_soon)
        self._refreshing: asyncio.Future | None = None
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
            entries = await self.store.servers()
            servers = {s.name: s.grpc_address for s in entries}
            self._link_addresses = {s.grpc_address: s.link for s in entries
                                    if s.link and s.role == "partition_server"}
            self._owners = {t.name: [servers.get(owner, "") for owner in t.owners]
                            for t in await self.store.topics()}
            self._refreshed_at = time.monotonic()
            # Channels and links to servers that are gone (a replaced machine or pod
            # with another address) are closed, not kept for good.
            current = {s.grpc_address for s in entries}
            self._stubs.retain(current)
            self._links.retain(current)

    def cached_partition_count(self, topic: str) -> int | None:
        """Partitions of a topic as cached (None: not cached, ask `partition_count`)."""
        owners = self._owners.get(topic)
        return None if owners is None else len(owners)

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
        """One channel and one stub per address; in-process where this process owns it;
        where the server has a link, its StageTxn, Produce and EndTxnOnPartition go over
        the link (copy_link.CallLink; over TLS when the process has TLS)."""
        stub = self._stubs.get(address)
        if not self.use_links:
            return stub
        return self._links.stub(address, self._link_addresses.get(address, ""), stub)

    def refresh_soon(self) -> None:
        """A refresh in the background (one at a time), for a caller that does not wait
        for it: a marker that failed for a routing reason, or a link that could not be
        reached (its server may have restarted with another link address; the calls go
        over gRPC meanwhile)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh(force=True))
            self._refreshing.add_done_callback(_refresh_done)

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        self._links.close()
        await self._stubs.close()


def _refresh_done(task: asyncio.Future) -> None:
    """A background refresh that failed (ZooKeeper away): said, not left to asyncio's
    "never retrieved" error; the next failed call asks again."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        event(log, "routes not refreshed; the next failed call asks again", logging.WARNING,
              error=f"{type(error).__name__}: {error}")
