"""A real process that holds budget grants in Redis, for the crash tests (killed by pid).

``hold URL TENANT N LEASE_S``: reserve N grants of 900 tokens, print ``held N``, renew them every LEASE_S / 3
until killed (exits by itself after two minutes).
``crash URL N SEED``: N times, fork a child that makes random reserves, settles, releases and
renews over five tenants, and SIGKILL it (by pid) at a random moment; four run at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

from guard.budget.connection import connect
from guard.budget.redis_store import RedisStore
from guard.budget.store import BudgetLimits, Grant

LIMITS = BudgetLimits(tokens_per_minute=100_000, requests_per_minute=10_000, max_concurrent=1000)


async def hold(url: str, tenant: str, count: int, lease_s: float) -> None:
    client = await connect(url, 2.0)
    store = RedisStore(client, lambda t: LIMITS, settle_delay_s=0)
    grants = [await store.reserve(tenant, 900, lease_s) for _ in range(count)]
    assert all(isinstance(g, Grant) for g in grants)
    print(f"held {len(grants)}", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        await asyncio.sleep(lease_s / 3)
        await store.renew(grants, lease_s)


async def churn(url: str, seed: int) -> None:
    rng = random.Random(seed)
    client = await connect(url, 2.0)
    store = RedisStore(client, lambda t: LIMITS, settle_delay_s=rng.choice([0, 0.01]))
    held: list[Grant] = []
    for _ in range(100_000):
        tenant = f"churn{rng.randrange(5)}"
        op = rng.random()
        if op < 0.5 or not held:
            outcome = await store.reserve(tenant, rng.randint(1, 500), rng.uniform(0.2, 3.0))
            if isinstance(outcome, Grant):
                held.append(outcome)
        elif op < 0.7:
            await store.settle(held.pop(rng.randrange(len(held))), rng.randint(0, 500))
        elif op < 0.85:
            await store.release(held.pop(rng.randrange(len(held))))
        else:
            await store.renew(held[-5:], rng.uniform(0.2, 3.0))


def crash(url: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    alive: list[int] = []
    for i in range(count):
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(churn(url, seed * 1000 + i))
            finally:
                os._exit(0)
        alive.append(pid)
        time.sleep(rng.uniform(0.005, 0.05))  # each child lives ~4 of these: many operations
        if len(alive) >= 4 or i == count - 1:
            for victim in (alive if i == count - 1 else [alive.pop(rng.randrange(len(alive)))]):
                os.kill(victim, signal.SIGKILL)
                os.waitpid(victim, 0)
            if i == count - 1:
                alive.clear()
    print(f"crashed {count}", flush=True)


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "hold":
        asyncio.run(hold(url, sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
    else:
        crash(url, int(sys.argv[3]), int(sys.argv[4]))
