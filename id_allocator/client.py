"""Client side of the allocator: a pool of producer ids that holds one block and
fetches the next at 90% use (Kafka's ProducerIdManager does the same), so asking
the allocator is rarely on a request's critical path.

- `BlockPool`: the pure part (current block, spare block, next id); no I/O.
- `ProducerIdPool`: blocking, thread-safe, fetches on a background thread (the SDK).
- `AsyncProducerIdPool`: asyncio, fetches in a task (the coordinator).
- `allocate_block` / `allocate_block_async`: one block with retries, for callers that
  manage blocks themselves.

Retries: every allocator address is tried in turn (starting at a random one) on a
retriable answer — ZOOKEEPER_UNAVAILABLE, ID_ALLOCATION_CONFLICT, SHUTTING_DOWN, a
refused connection or a deadline — with full-jitter backoff, at most `max_attempts`
calls. Retrying AllocateProducerIds is always safe: an answer that was lost only
leaves its block unused. Fatal answers (INVALID_ARGUMENT, PRODUCER_ID_SPACE_EXHAUSTED,
PRODUCER_ID_BLOCK_CORRUPT) are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import grpc

from atomlog.v1 import id_allocator_pb2, id_allocator_pb2_grpc
from id_allocator.core import Block
from services import local
from services.errors import AtomlogError, from_rpc_error
from services.tls import ChannelTls, channel

ID_ALLOCATOR_SERVICE = id_allocator_pb2.DESCRIPTOR.services_by_name["IdAllocatorService"].full_name

log = logging.getLogger("atomlog.id_allocator.client")

# Kafka's ProducerIdManager asks for the next block when 90% of the current one is used.
PREFETCH_RATIO = 0.9


class BlockPool:
    """The ids a client holds: the current block, at most one spare block, and the
    next id to hand out. Blocks must arrive in increasing order (fail closed)."""

    def __init__(self, prefetch_ratio: float = PREFETCH_RATIO):
        if not 0.0 < prefetch_ratio <= 1.0:
            raise ValueError(f"prefetch_ratio must be in (0, 1], got {prefetch_ratio}")
        self.prefetch_ratio = prefetch_ratio
        self.current: Block | None = None
        self.spare: Block | None = None
        self.next_id = 0
        self.highest_seen = 0

    @property
    def remaining(self) -> int:
        left = self.current.last - self.next_id + 1 if self.current else 0
        return left + (self.spare.size if self.spare else 0)

    def take(self) -> int | None:
        """The next id, or None when the pool is empty."""
        if (self.current is None or self.next_id > self.current.last) and self.spare is not None:
            self.current, self.spare = self.spare, None
            self.next_id = self.current.first
        if self.current is None or self.next_id > self.current.last:
            return None
        taken = self.next_id
        self.next_id += 1
        return taken

    def needs_block(self) -> bool:
        """True when no spare block is held and the current one is >= 90% used."""
        if self.spare is not None:
            return False
        if self.current is None:
            return True
        used = self.next_id - self.current.first
        return used >= self.prefetch_ratio * self.current.size

    def add(self, block: Block) -> None:
        if block.first <= self.highest_seen:
            raise ValueError(f"block [{block.first}, {block.last}] is not above the previous "
                             f"block's last id {self.highest_seen}")
        if self.spare is not None:
            raise ValueError("the pool already holds a spare block")
        self.highest_seen = block.last
        if self.current is None or self.next_id > self.current.last:
            self.current, self.next_id = block, block.first
        else:
            self.spare = block


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8
    call_timeout_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.call_timeout_s <= 0:
            raise ValueError("max_attempts must be >= 1 and call_timeout_s > 0")

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter backoff before retry `attempt` (1, 2, ...)."""
        return rng.uniform(0, min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempt - 1)))


def retriable(error: AtomlogError) -> bool:
    # A deadline is retriable here (unlike in general): a retry only gets a new block.
    return error.retriable or error.code in (grpc.StatusCode.UNAVAILABLE,
                                             grpc.StatusCode.DEADLINE_EXCEEDED)


def _request(count: int, requester: str) -> id_allocator_pb2.AllocateProducerIdsRequest:
    return id_allocator_pb2.AllocateProducerIdsRequest(count=count, requester=requester)


def _block(reply: id_allocator_pb2.AllocateProducerIdsResponse, count: int) -> Block:
    block = Block(reply.first_producer_id, reply.last_producer_id)
    if count and block.size != count:
        raise AtomlogError("INTERNAL", f"asked for {count} ids, got [{block.first}, {block.last}]")
    return block


def _give_up(last: AtomlogError, attempts: int) -> AtomlogError:
    return AtomlogError(last.reason, f"{last.message} (after {attempts} attempts)",
                        {**last.metadata, "attempts": attempts})


def allocate_block(stubs: Sequence[id_allocator_pb2_grpc.IdAllocatorServiceStub], count: int = 0,
                   requester: str = "", policy: RetryPolicy = RetryPolicy(),
                   rng: random.Random | None = None) -> Block:
    """One block from any of the allocators (blocking), with retries."""
    if not stubs:
        raise ValueError("no allocator to ask")
    rng = rng or random.Random()
    start = rng.randrange(len(stubs))
    last: AtomlogError | None = None
    for attempt in range(policy.max_attempts):
        if attempt:
            time.sleep(policy.delay_s(attempt, rng))
        stub = stubs[(start + attempt) % len(stubs)]
        try:
            return _block(stub.AllocateProducerIds(_request(count, requester),
                                                   timeout=policy.call_timeout_s), count)
        except grpc.RpcError as rpc_error:
            last = from_rpc_error(rpc_error)
            if not retriable(last):
                raise last from None
    assert last is not None
    raise _give_up(last, policy.max_attempts)


async def allocate_block_async(
        stubs: Sequence[id_allocator_pb2_grpc.IdAllocatorServiceStub], count: int = 0,
        requester: str = "", policy: RetryPolicy = RetryPolicy(),
        rng: random.Random | None = None) -> Block:
    """One block from any of the allocators (stubs on grpc.aio channels), with retries."""
    if not stubs:
        raise ValueError("no allocator to ask")
    rng = rng or random.Random()
    start = rng.randrange(len(stubs))
    last: AtomlogError | None = None
    for attempt in range(policy.max_attempts):
        if attempt:
            await asyncio.sleep(policy.delay_s(attempt, rng))
        stub = stubs[(start + attempt) % len(stubs)]
        try:
            return _block(await stub.AllocateProducerIds(_request(count, requester),
                                                         timeout=policy.call_timeout_s), count)
        except grpc.RpcError as rpc_error:
            last = from_rpc_error(rpc_error)
            if not retriable(last):
                raise last from None
    assert last is not None
    raise _give_up(last, policy.max_attempts)


class ProducerIdPool:
    """Blocking, thread-safe pool of producer ids over one or more allocators.

    `next_id()` returns at once while the pool holds ids; at 90% use of the current
    block it starts fetching the next one on a background thread. Only when the pool
    is empty does a caller wait (for at most one fetch's retries)."""

    def __init__(self, addresses: Sequence[str], *, block_size: int = 0, requester: str = "",
                 policy: RetryPolicy = RetryPolicy(), prefetch_ratio: float = PREFETCH_RATIO,
                 rng: random.Random | None = None, tls: ChannelTls | None = None):
        """`tls`: the CA (and client certificate) of a cluster serving TLS."""
        if not addresses:
            raise ValueError("no allocator address given")
        self._channels = [channel(a, tls) for a in addresses]
        self._stubs = [id_allocator_pb2_grpc.IdAllocatorServiceStub(c) for c in self._channels]
        self.block_size = block_size
        self.requester = requester
        self.policy = policy
        self._rng = rng or random.Random()
        self._pool = BlockPool(prefetch_ratio)
        self._cond = threading.Condition()
        self._fetching = False
        self._error: AtomlogError | None = None
        self._closed = False
        self.blocks_fetched = 0

    def next_id(self) -> int:
        with self._cond:
            while True:
                if self._closed:
                    raise AtomlogError("SHUTTING_DOWN", "the producer-id pool is closed")
                taken = self._pool.take()
                if taken is not None:
                    self._maybe_fetch()
                    return taken
                if self._error is not None and not self._fetching:
                    error, self._error = self._error, None
                    raise error
                self._maybe_fetch()
                self._cond.wait()

    def _maybe_fetch(self) -> None:
        if not self._fetching and self._pool.needs_block():
            self._fetching = True
            self._error = None
            threading.Thread(target=self._fetch, name="producer-id-fetch", daemon=True).start()

    def _fetch(self) -> None:
        block = error = None
        try:
            block = allocate_block(self._stubs, self.block_size, self.requester, self.policy,
                                   self._rng)
        except AtomlogError as raised:
            error = raised
        except Exception as raised:  # noqa: BLE001 — a bug; surfaced to the waiting caller
            log.exception("producer-id fetch failed")
            error = AtomlogError("INTERNAL", f"producer-id fetch failed: {raised!r}")
        with self._cond:
            self._fetching = False
            if block is not None and not self._closed:
                try:
                    self._pool.add(block)
                    self.blocks_fetched += 1
                except ValueError as refused:
                    error = AtomlogError("INTERNAL", str(refused))
            if error is not None:
                log.warning("producer-id fetch failed: %s", error)
                self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "ProducerIdPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncProducerIdPool:
    """The asyncio twin of ProducerIdPool (one event loop; not thread-safe)."""

    def __init__(self, addresses: Sequence[str], *, block_size: int = 0, requester: str = "",
                 policy: RetryPolicy = RetryPolicy(), prefetch_ratio: float = PREFETCH_RATIO,
                 rng: random.Random | None = None):
        if not addresses:
            raise ValueError("no allocator address given")
        # An allocator in this same process (the combined server) is called directly.
        self._stub_cache = local.StubCache(ID_ALLOCATOR_SERVICE,
                                           id_allocator_pb2_grpc.IdAllocatorServiceStub)
        self._stubs = [self._stub_cache.get(a) for a in addresses]
        self.block_size = block_size
        self.requester = requester
        self.policy = policy
        self._rng = rng or random.Random()
        self._pool = BlockPool(prefetch_ratio)
        self._fetch: asyncio.Task | None = None
        self.blocks_fetched = 0

    async def next_id(self) -> int:
        while True:
            taken = self._pool.take()
            if taken is not None:
                self._maybe_fetch()
                return taken
            task = self._maybe_fetch() or self._fetch
            assert task is not None
            try:
                await asyncio.shield(task)  # raises the fetch's error to every waiter
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # (this request's own cancellation)
                # The fetch was cancelled, not this request: the pool was closed (the
                # coordinator replaced it, its allocators having moved). Retriable: the
                # caller asks the pool in use now (it answered CANCELLED before, which a
                # client takes for INTERNAL and does not retry).
                raise AtomlogError("SERVER_UNAVAILABLE", "the producer-id pool was "
                                   "replaced while this request waited for a block",
                                   {"retry_after_ms": "50"}) from None

    def _maybe_fetch(self) -> asyncio.Task | None:
        if self._fetch is not None or not self._pool.needs_block():
            return None
        self._fetch = asyncio.get_running_loop().create_task(self._fetch_block())
        self._fetch.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._fetch

    async def _fetch_block(self) -> None:
        try:
            block = await allocate_block_async(self._stubs, self.block_size, self.requester,
                                               self.policy, self._rng)
            try:
                self._pool.add(block)
            except ValueError as refused:
                raise AtomlogError("INTERNAL", str(refused)) from None
            self.blocks_fetched += 1
        finally:
            self._fetch = None

    async def close(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
        await self._stub_cache.close()


def allocator_addresses(bootstrap: str, timeout_s: float = 5.0,
                        tls: ChannelTls | None = None) -> list[str]:
    """gRPC addresses of the registered id allocators, from any server's metadata."""
    from atomlog.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc

    with channel(bootstrap, tls) as opened:
        try:
            reply = metadata_pb2_grpc.MetadataServiceStub(opened).GetMetadata(
                metadata_pb2.GetMetadataRequest(), timeout=timeout_s)
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error) from None
    return [s.grpc_address for s in reply.servers
            if s.role == common_pb2.SERVER_ROLE_ID_ALLOCATOR]
