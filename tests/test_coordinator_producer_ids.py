"""The coordinator's producer ids (coordinator/producer_ids.py) when the id allocators
move: a pool replaced while a request waits on its block does not fail that request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from coordinator.producer_ids import ProducerIds
from id_allocator import client as allocator_client
from id_allocator.core import Block
from services.errors import AtomlogError


@dataclass
class Server:
    grpc_address: str
    role: str = "id_allocator"


class Store:
    def __init__(self):
        self.addresses = ["127.0.0.1:1"]

    async def servers(self):
        return [Server(a) for a in self.addresses]


def test_a_request_waiting_on_a_replaced_pool_gets_an_id(monkeypatch):
    """Request A's block fetch failed (its allocator moved); in the same turn request D
    took the old pool and began a new fetch; A then replaced the pool, and closing the
    old one cancelled D's fetch: D's InitProducerId failed CANCELLED (INTERNAL to the
    client, which does not retry it). Now D goes on with the new pool."""
    store = Store()
    calls = []

    async def allocate(stubs, count=0, requester="", policy=None, rng=None):
        calls.append(len(calls))
        if len(calls) == 1:
            raise AtomlogError("SERVER_UNAVAILABLE", "the allocator moved")
        if len(calls) == 2:
            await asyncio.sleep(0.05)  # D's fetch on the old pool, cancelled meanwhile
        return Block(3000 + 100 * len(calls), 3000 + 100 * len(calls) + 9)

    monkeypatch.setattr(allocator_client, "allocate_block_async", allocate)

    async def scenario():
        ids = ProducerIds(store, "coord-0")
        first_pool = await ids._current_pool(refresh=False)
        a = asyncio.ensure_future(ids.next_id())
        await asyncio.sleep(0)  # A's fetch has failed; A now refreshes
        store.addresses = ["127.0.0.1:2"]  # the allocator restarted elsewhere
        d = asyncio.ensure_future(first_pool.next_id())  # D on the old pool, a new fetch
        got_a = await a
        try:
            got_d = await asyncio.wait_for(d, 5)
        except asyncio.CancelledError:
            raise AssertionError("D's request was cancelled with the old pool") from None
        except AtomlogError as error:
            assert error.retriable, error  # (the caller retries on the current pool)
            got_d = await ids.next_id()
        assert got_a != got_d and got_a > 0 and got_d > 0
        await ids.close()

    asyncio.run(scenario())
