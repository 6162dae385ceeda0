"""One harness per store backend so a single contract suite runs against all of them.

``Backend.store(limits)`` builds a fresh store inside the running event loop; ``advance(s)``
moves time forward (the memory store's injected clock; real time for Redis, which reads its
own clock); ``tenant()`` gives a name no other test uses.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

from guard.budget.connection import connect
from guard.budget.memory_store import MemoryStore
from guard.budget.redis_store import RedisStore
from guard.budget.store import BudgetLimits


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class MemoryBackend:
    name = "memory"

    def __init__(self) -> None:
        self.clock = FakeClock()
        self._ids = itertools.count()

    def tenant(self, base: str = "t") -> str:
        return f"{base}{next(self._ids)}"

    async def store(self, limits: BudgetLimits | dict[str, BudgetLimits]) -> MemoryStore:
        return MemoryStore(_lookup(limits), self.clock)

    async def advance(self, seconds: float) -> None:
        self.clock.now_s += seconds


class RedisBackend:
    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url

    def tenant(self, base: str = "t") -> str:
        return f"{base}{uuid.uuid4().hex[:12]}"

    async def store(self, limits: BudgetLimits | dict[str, BudgetLimits]) -> RedisStore:
        client = await connect(self.url, timeout_s=2.0)  # generous: a hang guard on a busy box
        store = RedisStore(client, _lookup(limits))
        await store.scripts.load(client)
        return store

    async def advance(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _lookup(limits):
    if isinstance(limits, BudgetLimits):
        return lambda tenant: limits
    return lambda tenant: limits.get(tenant, BudgetLimits())
