"""Redis specifics beyond the contract: script reloads, TTLs on every key, Cluster slots."""

from __future__ import annotations

import asyncio

from budget_backends import RedisBackend

from guard.budget.keys import tenant_keys
from guard.budget.store import BudgetLimits, Grant


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_script_flush_answers_noscript_and_the_scripts_are_reloaded(redis_server):
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        store, tenant = await backend.store(BudgetLimits(requests_per_minute=5)), backend.tenant()
        assert isinstance(await store.reserve(tenant, 5, 30.0), Grant)
        redis_server.cli("script", "flush")
        assert isinstance(await store.reserve(tenant, 5, 30.0), Grant)
        assert store.scripts.num_reloads == 1
        await store.aclose()
    run(go())


def test_every_key_the_scripts_write_has_a_ttl(redis_server):
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        limits = BudgetLimits(tokens_per_minute=10_000, requests_per_minute=100, max_concurrent=9)
        store, tenant = await backend.store(limits), backend.tenant()
        grants = [await store.reserve(tenant, 50, 5.0) for _ in range(5)]
        await store.settle(grants[0], 10)
        await store.release(grants[1])
        await store.renew(grants[2:], 10.0)
        await store.flush()
        return tenant
    tenant = run(go())
    for key in tenant_keys(tenant):
        ttl_ms = int(redis_server.cli("pttl", key))
        assert 0 < ttl_ms <= 10_000 + 60_000 + 1000, (key, ttl_ms)


def test_cluster_spreads_tenants_over_masters_without_crossslot(redis_cluster):
    backend = RedisBackend("cluster", redis_cluster.url)

    async def go():
        store = await backend.store(BudgetLimits(max_concurrent=3))
        tenants = [backend.tenant() for _ in range(12)]
        for tenant in tenants:
            grant = await store.reserve(tenant, 5, 30.0)
            await store.settle(grant, 1)
            await store.renew([await store.reserve(tenant, 5, 30.0)], 30.0)
        await store.aclose()
    run(go())
    used = [n for n in redis_cluster.nodes if int(n.cli("dbsize").strip() or 0) > 0]
    assert len(used) >= 2  # the tenants' slots live on different masters
    for node in redis_cluster.nodes:
        assert "CROSSSLOT" not in node.cli("info", "errorstats")
