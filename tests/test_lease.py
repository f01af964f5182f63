"""partition_server/lease.py: a stall between ticks makes the server distrust its
ZooKeeper session until a round trip sent after the stall confirms it; a disconnected
client is never trusted (pure: a fake clock and fake ZooKeeper calls)."""

from __future__ import annotations

import asyncio
import logging

from partition_server.lease import LeaseWatch


def test_a_stall_is_distrusted_until_zookeeper_confirms_the_session(caplog):
    async def scenario():
        now = [100.0]
        connected = [True]
        answers: asyncio.Queue = asyncio.Queue()
        calls = []

        async def confirm():
            calls.append(now[0])
            outcome = await answers.get()
            if outcome is not None:
                raise outcome

        watch = LeaseWatch(lambda: connected[0], confirm, stall_s=1.0, clock=lambda: now[0])
        assert watch.trusted()
        now[0] += 0.5  # ticks this close: no stall
        assert watch.trusted() and not calls
        now[0] += 5.0  # paused past the session: distrusted at once, a round trip begins
        assert not watch.trusted() and watch.stalls == 1
        await asyncio.sleep(0)
        assert calls == [105.5]
        answers.put_nowait(ConnectionError("session expired"))  # the first one fails
        await asyncio.sleep(0.01)
        assert not watch.trusted()
        await asyncio.sleep(0.3)  # retried
        assert len(calls) == 2
        answers.put_nowait(ConnectionError("session expired"))  # the same failure again
        await asyncio.sleep(0.3)
        assert len(calls) == 3
        # Said once at WARNING (every subscription delivery waits), not at each retry.
        warned = [r for r in caplog.records if r.levelno == logging.WARNING
                  and "not confirmed" in r.getMessage()]
        assert len(warned) == 1 and "session expired" in warned[0].fields["error"]
        answers.put_nowait(None)
        await asyncio.sleep(0.01)
        assert watch.trusted() and watch.stalls == 1
        connected[0] = False  # the client lost its connection: not trusted
        assert not watch.trusted()
        connected[0] = True
        assert watch.trusted()
        await watch.close()

    asyncio.run(scenario())
