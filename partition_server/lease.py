"""Whether this server can still trust that it holds its ZooKeeper session, and so the
leaderships that session stands for (docs/replication.md, "A leader that was paused").

A replicated leader that was paused (SIGSTOP, a long GC-like stall, a VM freeze) past its
session timeout has been replaced, but until its ZooKeeper client hears so it still acts
as the leader. Writes are safe (nothing is acknowledged without followers, and they follow
the new leader), and log reads only show replicated data; but a subscription's deliveries
come from the leader's in-memory view of the cursor, so a stale leader would hand out
messages the new leader already has acknowledged or pending in a transaction.

`LeaseWatch` ticks on the event loop. A gap between ticks longer than `stall_s` means the
process (or its loop) stood still: from then on it is not trusted until `confirm`
succeeds: a ZooKeeper round trip sent after the stall, then every leadership here checked
against ZooKeeper's state (kazoo replaces an expired session by itself, so a connected
client alone proves nothing; steering steps a stale leadership down, and the check then
passes). While the client is not connected it is not trusted either (kazoo notices a
lost connection after two thirds of the session timeout, before the ensemble expires the
session).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from services.logs import event

log = logging.getLogger("atomlog.partition.lease")

TICK_S = 0.1
CONFIRM_RETRY_S = 0.25


class LeaseWatch:
    def __init__(self, connected: Callable[[], bool], confirm: Callable[[], Awaitable[None]],
                 stall_s: float, clock: Callable[[], float] = time.monotonic):
        """`connected`: whether the ZooKeeper client is connected now; `confirm`: raises
        unless this server still holds what it leads (a round trip to ZooKeeper and the
        check of its leaderships); `stall_s`: a gap between ticks longer than this is a
        stall."""
        self._connected = connected
        self._confirm = confirm
        self.stall_s = stall_s
        self._clock = clock
        self.last_tick = clock()
        self.suspect = False  # a stall was seen and no round trip since confirmed
        self.stalls = 0
        self._task: asyncio.Task | None = None
        self._confirming: asyncio.Task | None = None

    def start(self) -> None:
        self.last_tick = self._clock()
        self._task = asyncio.create_task(self._run(), name="lease watch")

    async def close(self) -> None:
        tasks = [task for task in (self._task, self._confirming) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def trusted(self) -> bool:
        """The session may still be this server's: no stall since the last confirmed
        round trip, and the client is connected."""
        self.tick()  # a request may run before the tick task after a stall
        return not self.suspect and self._connected()

    def tick(self) -> None:
        now = self._clock()
        gap = now - self.last_tick
        self.last_tick = now
        if gap > self.stall_s:
            self.stalls += 1
            if not self.suspect:
                event(log, "stalled; subscription deliveries wait for ZooKeeper to confirm "
                      "the session", logging.WARNING, stalled_s=round(gap, 3))
            self.suspect = True
            if self._confirming is None or self._confirming.done():
                try:
                    self._confirming = asyncio.get_running_loop().create_task(
                        self._confirm_session(), name="lease confirm")
                except RuntimeError:  # no running loop (a unit test's direct call)
                    pass

    async def _run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

    async def _confirm_session(self) -> None:
        failing = ""  # the kind of error the last attempt failed with
        while self.suspect:
            try:
                await self._confirm()
                if self._connected():
                    self.suspect = False
                    event(log, "session confirmed after a stall")
                    return
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 — lost or expired: try again
                # Every subscription delivery of the server waits meanwhile: said at
                # WARNING once per kind of failure (before, only at DEBUG), then quiet.
                kind = type(error).__name__
                if kind != failing:
                    event(log, "the session is not confirmed yet; subscription deliveries "
                          "wait", logging.WARNING, error=f"{kind}: {error}",
                          retry_in_s=CONFIRM_RETRY_S)
                    failing = kind
                else:
                    log.debug("lease confirm: %s", error)
            await asyncio.sleep(CONFIRM_RETRY_S)
