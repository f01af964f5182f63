"""coordinator/staging.py's wait for a transaction's parts: one wait for all of them, each
part answered with its result, its failure, or REQUEST_TIMED_OUT at the transaction's
deadline; neither the deadline nor a cancelled caller cancels a part (other
transactions' parts share its call)."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.staging import StageChannel
from services.errors import AtomlogError


def test_parts_answer_in_order_with_results_failures_and_the_deadline():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = StageChannel(routes=None)
        done, failing, late, never = (loop.create_future() for _ in range(4))
        done.set_result("written")
        loop.call_later(0.02, failing.set_exception,
                        AtomlogError("NOT_PARTITION_OWNER", "moved"))
        loop.call_later(0.05, late.set_result, "late but in time")
        began = time.monotonic()
        outcomes = await channel._await_parts(
            [("a", None, done), ("b", None, failing), ("c", None, late), ("d", None, never)],
            began + 0.3)
        waited = time.monotonic() - began
        assert outcomes[0] == "written"
        assert isinstance(outcomes[1], AtomlogError) and outcomes[1].reason == "NOT_PARTITION_OWNER"
        assert outcomes[2] == "late but in time"
        assert isinstance(outcomes[3], AtomlogError)
        assert outcomes[3].reason == "REQUEST_TIMED_OUT" and "staging on d" in outcomes[3].message
        assert 0.25 <= waited < 2.0  # the deadline, once for all parts
        assert not never.done()  # the part goes on for the transactions sharing its call
        never.cancel()

    asyncio.run(scenario())


def test_parts_all_done_already_are_answered_without_waiting():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = StageChannel(routes=None)
        first, second = loop.create_future(), loop.create_future()
        first.set_result(1)
        second.set_exception(AtomlogError("STALE_COORDINATOR_EPOCH", "fenced"))
        # A deadline already past: nothing is waited for, nothing is timed out.
        outcomes = await channel._await_parts([("a", None, first), ("b", None, second)],
                                              time.monotonic() - 1)
        assert outcomes[0] == 1 and outcomes[1].reason == "STALE_COORDINATOR_EPOCH"

    asyncio.run(scenario())


def test_a_cancelled_caller_leaves_its_parts_running():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = StageChannel(routes=None)
        part = loop.create_future()
        waiting = asyncio.ensure_future(channel._await_parts([("a", None, part)],
                                                             time.monotonic() + 5))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not part.done()
        part.set_result("still answered")

    asyncio.run(scenario())
