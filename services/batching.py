"""Calls to other servers, batched per destination (what server-to-server traffic shares).

`PerDestination(send)` keeps a queue per destination address and one sender task per
address with something queued. The task sends everything queued, up to a bound of items
(and bytes), in ONE call — `await send(address, items)`, which returns one result per
item, in order — and answers each item's future with its result. While that call is in
flight the next items queue, and they leave together in the next call: the call in
flight is the linger, so under load the calls per item fall, and with nothing else
queued an item leaves at once. A call that fails answers every item of it with the
failure (an AtomlogError; anything else becomes INTERNAL); a result that is an
exception fails its item alone (items of different kinds sharing a call).

With `settle_turns`, a sender whose call was answered while more is queued lets that
many event-loop turns pass before the next call takes the queue: what the answers lead
to in this process within those turns (a coordinator's decisions and markers, once a
transaction's stages are answered) joins that call instead of waiting for the one after
it. Turns, not time: with nothing queued the next item still leaves at once.

Used by the coordinator's staging of one-call transactions and the TC-log appends riding
with it (coordinator/staging.py), its other TC-log appends (coordinator/txn_log.py), and
by the partition server's verifications (partition_server/verifier.py). Markers
(coordinator/markers.py) batch the same way but confirm each target back to its TC
partition instead of answering a caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from services.errors import AtomlogError

T = TypeVar("T")


class PerDestination(Generic[T]):
    def __init__(self, send: Callable[[str, list[T]], Awaitable[list]], *, what: str,
                 max_items: int = 1_000, max_bytes: int = 0,
                 size: Callable[[T], int] | None = None, settle_turns: int = 0):
        """`max_bytes` (with `size`) also bounds a call: 0 means items only.
        `settle_turns`: event-loop turns to let pass after a call's answers, before the
        next call takes what is queued."""
        self.settle_turns = settle_turns
        self._send = send
        self.what = what
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._size = size
        self._queues: dict[str, list[tuple[T, asyncio.Future]]] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self.calls = 0  # made so far (the calls-per-item figure divides by it)

    def submit(self, address: str, item: T) -> asyncio.Future:
        """Queue `item` for `address`; its future gets the item's result."""
        future = asyncio.get_running_loop().create_future()
        # A caller may stop waiting (its deadline passed: coordinator/staging.py waits on
        # a shield of it; or it was cancelled): a failure that then comes is looked at
        # here, so asyncio does not log it as "never retrieved". Whoever awaits still
        # gets it.
        future.add_done_callback(observe_failure)
        self._queues.setdefault(address, []).append((item, future))
        task = self._senders.get(address)
        if task is None or task.done():
            self._senders[address] = asyncio.create_task(self._send_all(address),
                                                          name=f"{self.what}->{address}")
        return future

    def busy(self, address: str) -> bool:
        """Whether a call to `address` is in flight or items wait for one: what is
        submitted now leaves with the next call (a rider), not in a call of its own."""
        task = self._senders.get(address)
        return task is not None and not task.done()

    def _take(self, queue: list) -> list:
        """The oldest queued entries that fit one call (at least one)."""
        count, size = 0, 0
        for item, _ in queue:
            if count >= self.max_items:
                break
            if self.max_bytes:
                size += self._size(item)
                if count and size > self.max_bytes:
                    break
            count += 1
        group = queue[:count]
        del queue[:count]
        return group

    async def _send_all(self, address: str) -> None:
        queue = self._queues.setdefault(address, [])
        try:
            await self._drain(address, queue)
        finally:
            # Nothing left for `address`: its entries go (no await between the empty
            # queue and here, so nothing was queued meanwhile). Before, every address
            # ever called kept a list and a finished task: a coordinator's pod address,
            # new at every roll, stayed in each partition server's verifier for good.
            if not queue and self._queues.get(address) is queue and \
                    self._senders.get(address) is asyncio.current_task():
                del self._queues[address]
                del self._senders[address]

    async def _drain(self, address: str, queue: list) -> None:
        while queue:
            group = self._take(queue)
            self.calls += 1
            try:
                results = await self._send(address, [item for item, _ in group])
                if len(results) != len(group):
                    raise AtomlogError("INTERNAL", f"{address} answered {len(results)} "
                                       f"results for {len(group)} {self.what} items")
            except Exception as error:  # noqa: BLE001 — every item gets an answer
                failure = error if isinstance(error, AtomlogError) else AtomlogError(
                    "INTERNAL", f"{self.what} to {address} failed: {error}")
                for _, future in group:
                    if not future.done():
                        future.set_exception(failure)
                continue
            for (_, future), result in zip(group, results):
                if not future.done():
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
            if queue:
                for _ in range(self.settle_turns):
                    await asyncio.sleep(0)

    async def close(self) -> None:
        tasks = list(self._senders.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for queue in self._queues.values():
            for _, future in queue:
                if not future.done():
                    future.cancel()


def resolve(future: asyncio.Future | None) -> None:
    """Wake whoever waits on `future` (a wake-up with no value), unless it is done."""
    if future is not None and not future.done():
        future.set_result(None)


def observe_failure(future: asyncio.Future) -> None:
    """Mark a done future's exception as looked at, so asyncio does not log it as "never
    retrieved" when no one awaits it any more; an await still raises it."""
    if not future.cancelled():
        future.exception()


def failure_of(future: asyncio.Future, what: str) -> AtomlogError | None:
    """A done future's failure as an AtomlogError (None when it succeeded): its own,
    SHUTTING_DOWN when it was cancelled, INTERNAL naming `what` for anything else."""
    if future.cancelled():
        return AtomlogError("SHUTTING_DOWN", f"{what} was cancelled")
    error = future.exception()
    if error is None or isinstance(error, AtomlogError):
        return error
    return AtomlogError("INTERNAL", f"{what} failed: {error!r}")


class WhenAllDone:
    """Calls `then()` once every one of `futures` is done (a done-callback on each, one
    object: no task, no gather). Every future must be added at once."""

    __slots__ = ("left", "then")

    def __init__(self, futures: list, then: Callable[[], None]):
        self.left = len(futures)
        self.then = then
        if not futures:
            then()
        for future in futures:
            future.add_done_callback(self)

    def __call__(self, _future) -> None:
        self.left -= 1
        if self.left == 0:
            self.then()
