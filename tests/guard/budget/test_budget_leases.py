"""Leases: a guard process that dies holding grants gives them back within the lease TTL, and
no crash ever leaves a key without a TTL. Real processes, SIGKILLed by pid."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

from budget_backends import RedisBackend

from guard.budget.keys import tenant_keys
from guard.budget.store import BudgetLimits, Grant

HOLDER = Path(__file__).with_name("budget_holder.py")


def test_sigkilled_holder_of_100_grants_frees_slots_and_tokens_within_the_lease(redis_server):
    tenant, lease_s = f"crash{time.time_ns()}", 1.5
    holder = subprocess.Popen([sys.executable, str(HOLDER), "hold", redis_server.url, tenant,
                               "100", str(lease_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held 100"
        leases_key = tenant_keys(tenant)[1]
        assert int(redis_server.cli("zcard", leases_key)) == 100
        killed_s = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    # the holder's tokens per minute (100 000, of which it held 90 000), and 100 slots
    limits = BudgetLimits(tokens_per_minute=100_000, requests_per_minute=10_000, max_concurrent=100)
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        store = await backend.store(limits)
        ours: list[Grant] = []
        while len(ours) < 100:  # nobody does anything special: ordinary reserves reclaim
            outcome = await store.reserve(tenant, 1, 30.0)
            if isinstance(outcome, Grant):
                ours.append(outcome)
                continue
            assert outcome.reason == "concurrency_limit"
            assert time.monotonic() - killed_s < lease_s + 20  # hang guard, not a timing claim
            await asyncio.sleep(0.1)
        assert int(redis_server.cli("zcard", leases_key)) == 100  # only ours are left
        for grant in ours:
            await store.release(grant)
        # the dead holder's 90 000 tokens came back (refill alone would take ~54 s)
        assert isinstance(await store.reserve(tenant, 95_000, 30.0), Grant)
        await store.aclose()
    asyncio.run(asyncio.wait_for(go(), timeout=60))


def test_no_key_without_a_ttl_after_200_random_crashes(redis_server):
    driver = subprocess.run([sys.executable, str(HOLDER), "crash", redis_server.url, "200", "7"],
                            capture_output=True, text=True, timeout=240)
    assert driver.stdout.strip() == "crashed 200", driver.stderr[-2000:]
    keys = [k for k in redis_server.cli("--scan", "--pattern", "kvguard:*").split() if k]
    assert any("churn" in k for k in keys)  # the children did write
    for key in keys:
        # -1: a key without a TTL (the bug this guards against); -2: it expired since the
        # scan (short leases do), which is the TTL working
        assert int(redis_server.cli("pttl", key)) != -1, key
