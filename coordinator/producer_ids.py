"""Producer ids for idempotent producers: the coordinator holds a block from the id
allocators (prefetching the next at 90% use) and hands out one id per InitProducerId,
so ZooKeeper is rarely on a producer's start-up path."""

from __future__ import annotations

import asyncio
import logging

from id_allocator.client import AsyncProducerIdPool
from services.errors import AtomlogError

log = logging.getLogger("atomlog.coordinator.producer_ids")


class ProducerIds:
    def __init__(self, metadata_store, requester: str):
        self.metadata_store = metadata_store
        self.requester = requester
        self._pool: AsyncProducerIdPool | None = None
        self._addresses: tuple[str, ...] = ()
        self._lock = asyncio.Lock()

    async def _current_pool(self, refresh: bool) -> AsyncProducerIdPool:
        async with self._lock:
            if self._pool is not None and not refresh:
                return self._pool
            servers = await self.metadata_store.servers()
            addresses = tuple(sorted(s.grpc_address for s in servers if s.role == "id_allocator"))
            if not addresses:
                raise AtomlogError("SERVER_UNAVAILABLE", "no id allocator is registered",
                                   {"retry_after_ms": "500"})
            if self._pool is None or addresses != self._addresses:
                old, self._pool = self._pool, AsyncProducerIdPool(addresses,
                                                                  requester=self.requester)
                self._addresses = addresses
                if old is not None:
                    await old.close()
            return self._pool

    async def next_id(self) -> int:
        pool = await self._current_pool(refresh=False)
        try:
            return await pool.next_id()
        except AtomlogError as error:
            if not error.retriable:
                raise
            # The allocators may have moved (restart on new addresses): look again, once.
            pool = await self._current_pool(refresh=True)
            return await pool.next_id()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
