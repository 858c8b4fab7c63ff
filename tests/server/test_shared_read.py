"""SharedRead: a polling client cannot make the engine thread read more often than once a
ttl (the /metrics slot walk, the visualizer's /viz/state)."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm.server.shared_read import SharedRead


def test_concurrent_and_repeated_callers_share_one_read_per_ttl():
    calls = []

    async def read():
        calls.append(1)
        await asyncio.sleep(0.05)
        return len(calls)

    async def run():
        shared = SharedRead(read, ttl=0.3)
        first = await asyncio.gather(*(shared() for _ in range(50)))
        again = [await shared() for _ in range(20)]   # within the ttl: the same result, no call
        await asyncio.sleep(0.35)
        later = await shared()
        return first, again, later
    first, again, later = asyncio.run(run())
    assert first == [1] * 50 and again == [1] * 20
    assert later == 2 and len(calls) == 2


def test_a_caller_that_gives_up_does_not_cancel_the_read_for_the_others():
    async def read():
        await asyncio.sleep(0.2)
        return "done"

    async def run():
        shared = SharedRead(read, ttl=5)
        with pytest.raises(asyncio.TimeoutError):
            await shared(timeout=0.01)
        return await shared()
    assert asyncio.run(run()) == "done"
