"""One read of the engine shared by every caller for a short while: what a polling client
may ask as often as it likes without asking more of the engine thread (multi-tenant)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedRead(Generic[T]):
    """fn() at most once per `ttl` seconds: callers in between get the same call's result
    (or wait for it while it runs); one that gives up does not cancel it for the others."""

    def __init__(self, fn: Callable[[], Awaitable[T]], ttl: float) -> None:
        self.fn, self.ttl = fn, ttl
        self._task: asyncio.Future | None = None
        self._at = 0.0

    async def __call__(self, timeout: float = 30.0) -> T:
        now = time.monotonic()
        if self._task is None or now - self._at > self.ttl:
            self._task, self._at = asyncio.ensure_future(self.fn()), now
        return await asyncio.wait_for(asyncio.shield(self._task), timeout)
