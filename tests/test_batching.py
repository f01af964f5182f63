"""services/batching.py: one call per destination for everything queued meanwhile, every
item answered (a failed call answers each with its failure), and a failure nobody waits
for any more (the caller's deadline passed) not reported as a "never retrieved" error."""

from __future__ import annotations

import asyncio
import gc

from services.batching import PerDestination
from services.errors import AtomlogError


def test_items_queued_during_a_call_leave_together_and_failures_answer_each():
    calls: list[tuple[str, list[int]]] = []

    async def scenario():
        gate = asyncio.Event()

        async def send(address: str, items: list[int]) -> list:
            calls.append((address, list(items)))
            await gate.wait()
            if address == "down":
                raise OSError("connection refused")
            return [item * 10 for item in items]

        batching = PerDestination(send, what="test", max_items=3)
        first = batching.submit("a", 1)
        await asyncio.sleep(0)  # the first call is in flight
        rest = [batching.submit("a", i) for i in (2, 3, 4, 5)]
        failed = batching.submit("down", 7)
        await asyncio.sleep(0)
        gate.set()
        assert await first == 10
        assert [await f for f in rest] == [20, 30, 40, 50]
        try:
            await failed
        except AtomlogError as error:
            assert error.reason == "INTERNAL" and "connection refused" in error.message
        else:
            raise AssertionError("a failed call must fail its items")
        await batching.close()

    asyncio.run(scenario())
    assert calls == [("a", [1]), ("down", [7]), ("a", [2, 3, 4]), ("a", [5])]


def test_a_failure_nobody_waits_for_is_not_logged_as_never_retrieved():
    reported: list[dict] = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context:
                                                         reported.append(context))

        async def send(_address: str, _items: list[int]) -> list:
            await asyncio.sleep(0.05)
            raise AtomlogError("REQUEST_TIMED_OUT", "Deadline Exceeded")

        batching = PerDestination(send, what="test")
        future = batching.submit("a", 1)
        try:  # the caller's own deadline passes first, as staging's does
            await asyncio.wait_for(asyncio.shield(future), 0.01)
        except TimeoutError:
            pass
        await asyncio.sleep(0.1)  # the call fails after the caller left
        assert future.done()
        del future
        gc.collect()
        await batching.close()

    asyncio.run(scenario())
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported


def test_an_address_with_nothing_left_to_send_is_forgotten():
    """Each address keeps a queue and a sender task only while it has items: before, every
    address ever called kept both for good (a coordinator's pod address, new at every
    restart, stayed in each partition server's verifier). A later item starts anew."""
    async def scenario():
        async def send(address: str, items: list[int]) -> list:
            await asyncio.sleep(0)
            return items

        batching = PerDestination(send, what="test")
        assert await batching.submit("old-pod", 1) == 1
        await asyncio.sleep(0)  # the sender's last step
        assert batching._queues == {} and batching._senders == {}
        first = batching.submit("a", 2)
        second = batching.submit("a", 3)
        assert [await first, await second] == [2, 3]
        assert await batching.submit("a", 4) == 4
        await asyncio.sleep(0)
        assert batching._queues == {} and batching._senders == {}
        await batching.close()

    asyncio.run(scenario())


def test_with_settle_turns_what_answers_lead_to_joins_the_next_call():
    """Item 1's answer leads to item 3 a few event-loop turns later (as a staged
    transaction's decision follows its stages' answers); item 2 was queued meanwhile.
    With settle turns the next call waits those turns and carries both; without, it
    leaves with item 2 alone and item 3 needs a call of its own. Either way one
    `send` at a time, and every item answered."""
    def calls_with(settle_turns: int) -> list[list[int]]:
        calls: list[list[int]] = []

        async def scenario():
            gate = asyncio.Event()

            async def send(_address: str, items: list[int]) -> list:
                calls.append(list(items))
                await gate.wait()
                return items

            batching = PerDestination(send, what="test", settle_turns=settle_turns)

            async def then_three() -> int:
                await batching.submit("a", 1)
                for _ in range(3):  # the consequence takes a few turns to come
                    await asyncio.sleep(0)
                return await batching.submit("a", 3)

            follow = asyncio.ensure_future(then_three())
            while not calls:  # item 1's call is in flight
                await asyncio.sleep(0)
            second = batching.submit("a", 2)
            gate.set()
            assert [await second, await follow] == [2, 3]
            await batching.close()

        asyncio.run(scenario())
        return calls

    assert calls_with(0) == [[1], [2], [3]]
    assert calls_with(6) == [[1], [2, 3]]
