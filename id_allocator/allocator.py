"""The allocator's owner task: one per process, the only code that writes the znode.

Why one owner task with a bounded queue rather than an asyncio.Lock around each RPC:
- batching: the owner takes every request queued while the previous write was in
  flight (up to id_allocator.max_requests_per_write) and serves them all with ONE
  compare-and-set, so a burst of N callers costs one ZooKeeper round trip, not N;
- a caller that gives up (deadline, cancellation) never interrupts a write in flight:
  the owner finishes the round, resolves a lost reply if there was one, and simply
  drops that caller's block (a gap, never a duplicate);
- the queue is the bound: when it is full, callers get RESOURCE_EXHAUSTED at once.
Concurrent rounds in one process would only lose CAS races to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

from id_allocator import metrics
from id_allocator.core import (Allocation, Block, Done, Failed, Read, Request, Snapshot, State,
                               Write, backoff_bound_ms, resolve_count, validate_requester)
from id_allocator.store import (WriteConflict, WriteOk, WriteUncertain, ZkBlockStore,
                                ZooKeeperUnavailable)
from services.config import ROLE_SETTINGS
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.id_allocator")


@dataclass(frozen=True)
class AllocatorSettings:
    """The `id_allocator.*` settings (declared, with bounds and meaning, in services/config.py)."""

    default_block_size: int
    max_block_size: int
    cas_max_attempts: int
    cas_backoff_initial_ms: int
    cas_backoff_max_ms: int
    zookeeper_op_timeout_ms: int
    max_pending_requests: int
    max_requests_per_write: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "AllocatorSettings":
        return cls(**{name: config[f"id_allocator.{name}"] for name in cls.__dataclass_fields__})

    @classmethod
    def defaults(cls, **changes: int) -> "AllocatorSettings":
        declared = {s.name: s.default for s in ROLE_SETTINGS["id_allocator"]}
        return replace(cls.from_config(declared), **changes)


@dataclass
class _Pending:
    request: Request
    future: asyncio.Future


class Allocator:
    def __init__(self, store: ZkBlockStore, name: str, settings: AllocatorSettings,
                 rng: random.Random | None = None):
        self.store = store
        self.name = name
        self.settings = settings
        self._rng = rng or random.Random()
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(settings.max_pending_requests)
        self._owner: asyncio.Task | None = None
        self._stopping = False
        # The highest id this process has seen in the znode: it must never go below it.
        self.floor = 0
        self.blocks_issued = 0
        self.conflicts = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        assert self._owner is None, "started twice"
        self._owner = asyncio.get_running_loop().create_task(self._run(), name="id-allocator")

    async def stop(self) -> None:
        """Refuse new requests; the round in flight finishes; queued ones fail."""
        self._stopping = True
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(AtomlogError(
                    "SHUTTING_DOWN", f"allocator {self.name} is stopping"))
        metrics.PENDING_REQUESTS.set(0)
        if self._owner is not None:
            self._owner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._owner

    # ------------------------------------------------------------------ requests
    async def allocate(self, count: int, requester: str = "") -> Block:
        """A block of `count` ids (0: the default size), durable in ZooKeeper."""
        try:
            size = resolve_count(count, self.settings.default_block_size,
                                 self.settings.max_block_size)
            request = Request(size, validate_requester(requester))
            if self._stopping:
                raise AtomlogError("SHUTTING_DOWN", f"allocator {self.name} is stopping")
            future = asyncio.get_running_loop().create_future()
            try:
                self._queue.put_nowait(_Pending(request, future))
            except asyncio.QueueFull:
                raise AtomlogError("RESOURCE_EXHAUSTED",
                                   f"{self._queue.maxsize} allocation requests are queued",
                                   {"limit": "id_allocator.max_pending_requests"}) from None
            metrics.PENDING_REQUESTS.set(self._queue.qsize())
            started = time.perf_counter()
            try:
                return await future
            finally:
                metrics.ALLOCATION_LATENCY.observe(time.perf_counter() - started)
        except AtomlogError as error:
            metrics.FAILURES.labels(error.reason).inc()
            raise

    async def describe(self) -> Snapshot:
        """The znode as it is now (read-only, not through the owner)."""
        try:
            data, version = await self.store.read()
        except ZooKeeperUnavailable as error:
            raise AtomlogError("ZOOKEEPER_UNAVAILABLE", str(error)) from None
        return Snapshot.parse(data, version)

    # ------------------------------------------------------------------ owner task
    async def _run(self) -> None:
        """Serve queued requests, a batch per round, until cancelled. Never dies of an
        error: a bug fails that round's callers with INTERNAL and the next round runs."""
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.settings.max_requests_per_write and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            metrics.PENDING_REQUESTS.set(self._queue.qsize())
            live = [p for p in batch if not p.future.done()]  # callers that gave up
            if not live:
                continue
            metrics.REQUESTS_PER_WRITE.observe(len(live))
            try:
                self._settle(live, await self.allocate_round(tuple(p.request for p in live)))
            except asyncio.CancelledError:
                self._fail(live, AtomlogError("SHUTTING_DOWN", f"allocator {self.name} is stopping"))
                raise
            except Exception as error:  # noqa: BLE001 — a bug; logged whole
                log.exception("allocation round failed")
                self._fail(live, AtomlogError("INTERNAL", f"allocation failed: {error!r}"))

    @staticmethod
    def _fail(live: list[_Pending], error: AtomlogError) -> None:
        for pending in live:  # one exception object per caller: raising it adds a traceback
            if not pending.future.done():
                pending.future.set_exception(AtomlogError(error.reason, error.message,
                                                          dict(error.metadata)))

    def _settle(self, live: list[_Pending], outcome: Done | Failed) -> None:
        if isinstance(outcome, Failed):
            self._fail(live, outcome.error)
            return
        for pending, result in zip(live, outcome.results, strict=True):
            if pending.future.done():
                continue  # the caller gave up: its block is never used (a gap)
            if isinstance(result, Block):
                self.blocks_issued += 1
                metrics.BLOCKS_ALLOCATED.inc()
                metrics.IDS_ALLOCATED.inc(result.size)
                pending.future.set_result(result)
            else:
                pending.future.set_exception(result)

    async def allocate_round(self, requests: tuple[Request, ...]) -> Done | Failed:
        """Drive one core Allocation against ZooKeeper until it is done or failed."""
        machine = Allocation(requests, self.name, self.settings.cas_max_attempts, self.floor)
        action = machine.start()
        while True:
            if isinstance(action, Read):
                action = await self._read(machine, action)
            elif isinstance(action, Write):
                action = await self._write(machine, action)
            else:
                self.floor = max(self.floor, machine.floor)
                if isinstance(action, Done):
                    metrics.WRITES.inc()
                else:  # ZooKeeper outages are logged once, as session state changes
                    quiet = action.error.reason == "ZOOKEEPER_UNAVAILABLE"
                    event(log, "allocation failed", logging.DEBUG if quiet else logging.WARNING,
                          reason=action.error.reason, error=action.error.message,
                          attempts=machine.attempts)
                return action

    async def _read(self, machine: Allocation, read: Read):
        if read.backoff_attempt:
            bound_ms = backoff_bound_ms(read.backoff_attempt, self.settings.cas_backoff_initial_ms,
                                        self.settings.cas_backoff_max_ms)
            await asyncio.sleep(self._rng.uniform(0, bound_ms) / 1000)
        resolving = machine.state is State.RESOLVING
        try:
            data, version = await self.store.read(sync=read.sync)
        except ZooKeeperUnavailable as error:
            if resolving:
                metrics.UNCERTAIN_WRITES.labels("unresolved").inc()
                event(log, "lost write reply not resolved; its block is never issued",
                      logging.WARNING, error=str(error))
            return machine.on_unavailable(str(error))
        try:
            snapshot: Snapshot | AtomlogError = Snapshot.parse(data, version)
        except AtomlogError as error:
            snapshot = error
        action = machine.on_read(snapshot, secrets.token_hex(16))
        if resolving:
            resolution = "ours" if isinstance(action, Done) else (
                "not_ours" if isinstance(action, Write) else "unresolved")
            metrics.UNCERTAIN_WRITES.labels(resolution).inc()
            event(log, "lost write reply resolved", resolution=resolution)
        return action

    async def _write(self, machine: Allocation, write: Write):
        try:
            result = await self.store.write(write.expected_version, write.data)
        except ZooKeeperUnavailable as error:
            return machine.on_unavailable(str(error))
        if isinstance(result, WriteOk):
            return machine.on_write_ok(result.version)
        if isinstance(result, WriteConflict):
            self.conflicts += 1
            metrics.CAS_CONFLICTS.inc()
            return machine.on_write_conflict()
        assert isinstance(result, WriteUncertain)
        event(log, "write reply lost; re-reading to resolve", logging.WARNING, why=result.why)
        return machine.on_write_uncertain()
