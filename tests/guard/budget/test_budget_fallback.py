"""Redis trouble never takes the guard down: a real redis-server the test kills, stops, restarts."""

from __future__ import annotations

import asyncio
import signal
import time

from prometheus_client import CollectorRegistry
from redis_servers import RedisServer, free_port

from guard.budget.config import BudgetConfig
from guard.budget.fallback import FallbackStore
from guard.budget.keys import tenant_keys
from guard.budget.metrics import BudgetMetrics
from guard.budget.store import BudgetLimits, Denied, Grant

SETTINGS = dict(heartbeat_s=0.2, lease_s=5.0, retry_max_s=0.3, breaker_failures=3,
                redis_timeout_s=0.05)
HANG_GUARD_S = 2.0  # far above the 50 ms Redis timeout: only catches a request stuck on Redis


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


def fallback(url: str, limits: BudgetLimits, registry=None, **settings) -> FallbackStore:
    config = BudgetConfig(**{**SETTINGS, **settings})
    metrics = BudgetMetrics(registry) if registry is not None else None
    store = FallbackStore(url, lambda tenant: limits, config, time.monotonic, metrics)
    store.start()
    return store


async def until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def timed_reserve(store, tenant, tokens=10):
    start = time.monotonic()
    outcome = await store.reserve(tenant, tokens, 5.0)
    assert time.monotonic() - start < HANG_GUARD_S
    return outcome


def test_starts_without_redis_on_the_local_share_and_moves_to_redis_when_it_appears():
    server = RedisServer(port=free_port())
    limits = BudgetLimits(requests_per_minute=4)

    async def go():
        store = fallback(server.url, limits)
        assert isinstance(await timed_reserve(store, "acme"), Grant)
        assert store.backend == "local"
        server.start()
        await until(lambda: store.backend == "redis")
        grant = await timed_reserve(store, "acme")
        assert isinstance(grant, Grant)
        assert server.cli("hexists", tenant_keys("acme")[2], grant.grant_id).strip() == "1"
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_redis_killed_breaker_opens_local_share_then_back_on_redis_with_scripts_reloaded():
    server = RedisServer().start()
    registry = CollectorRegistry()

    async def go():
        store = fallback(server.url, BudgetLimits(requests_per_minute=60), registry)
        await until(lambda: store.backend == "redis")
        for _ in range(5):
            assert isinstance(await timed_reserve(store, "acme"), Grant)
        server.kill()
        outcomes = [await timed_reserve(store, "acme") for _ in range(100)]
        assert store.breaker.is_open and store.backend == "local"
        # one guard live: its local share is the whole limit (a fresh local bucket)
        assert sum(isinstance(o, Grant) for o in outcomes) <= 60 + 3
        assert registry.get_sample_value("kvguard_budget_backend", {"backend": "local"}) == 1
        assert registry.get_sample_value("kvguard_budget_breaker_open") == 1
        server.start()  # a fresh server: no scripts loaded
        await until(lambda: store.backend == "redis")
        assert isinstance(await timed_reserve(store, "fresh"), Grant)
        assert registry.get_sample_value("kvguard_budget_backend", {"backend": "redis"}) == 1
        assert server.cli("exists", tenant_keys("fresh")[1]).strip() == "1"
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_hung_redis_never_holds_a_request_and_sigcont_brings_redis_back():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(requests_per_minute=600))
        await until(lambda: store.backend == "redis")
        server.signal(signal.SIGSTOP)
        try:
            for _ in range(10):
                assert isinstance(await timed_reserve(store, "acme"), Grant)
            assert store.breaker.is_open
        finally:
            server.signal(signal.SIGCONT)
        await until(lambda: store.backend == "redis")
        assert isinstance(await timed_reserve(store, "acme"), Grant)
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_local_share_divides_each_limit_by_the_live_guards():
    server = RedisServer().start()

    async def go():
        limits = BudgetLimits(requests_per_minute=30, max_concurrent=30)
        guards = [fallback(server.url, limits) for _ in range(3)]
        await until(lambda: all(g.backend == "redis" and g.live_guards == 3 for g in guards))
        server.kill()
        admitted = 0
        for guard in guards:
            outcomes = [await timed_reserve(guard, "acme") for _ in range(40)]
            admitted += sum(isinstance(o, Grant) for o in outcomes)
            assert any(isinstance(o, Denied) for o in outcomes)
        assert admitted <= 3 * (30 // 3) + 3 * 3  # the local shares (+ calls before the breaker)
        for guard in guards:
            await guard.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_grants_made_locally_are_settled_locally_after_recovery():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(tokens_per_minute=10_000))
        await until(lambda: store.backend == "redis")
        server.kill()
        local = [await timed_reserve(store, "acme", 100) for _ in range(5)]
        assert all(isinstance(g, Grant) for g in local) and store.backend == "local"
        server.start()
        await until(lambda: store.backend == "redis")
        for grant in local:
            await store.settle(grant, 50)
        await store.redis.flush()
        assert store.local.num_leases("acme") == 0
        # Redis never saw them: no bucket, no lease, no grant for the tenant
        assert server.cli("exists", *tenant_keys("acme")).strip() == "0"
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_metrics_rtt_reclaimed_leases_and_bounded_remaining_tokens():
    server = RedisServer().start()
    registry = CollectorRegistry()

    async def go():
        config = BudgetConfig(**SETTINGS)
        store = FallbackStore(server.url, lambda t: BudgetLimits(tokens_per_minute=1000), config,
                              time.monotonic, BudgetMetrics(registry, max_tenant_labels=2))
        store.start()
        await until(lambda: store.backend == "redis")
        assert isinstance(await store.reserve("a", 100, 0.3), Grant)  # never renewed
        await asyncio.sleep(0.5)
        for tenant in ("a", "b", "c"):
            assert isinstance(await store.reserve(tenant, 10, 5.0), Grant)
        assert registry.get_sample_value("kvguard_budget_lease_expiries_reclaimed_total") == 1
        assert registry.get_sample_value("kvguard_budget_redis_rtt_seconds_count") >= 4
        assert registry.get_sample_value("kvguard_budget_live_guards") == 1
        remaining = {t: registry.get_sample_value("kvguard_budget_remaining_tokens", {"tenant": t})
                     for t in ("a", "b", "c")}
        assert remaining["a"] is not None and 985 <= remaining["a"] <= 1000
        assert sum(v is not None for v in remaining.values()) == 2  # bounded label set
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_local_share_starts_from_what_redis_had_left():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(requests_per_minute=60))
        await until(lambda: store.backend == "redis")
        for _ in range(50):
            assert isinstance(await timed_reserve(store, "acme"), Grant)
        server.kill()
        outcomes = [await timed_reserve(store, "acme") for _ in range(60)]
        assert store.backend == "local"
        # 10 were left in Redis: the local share starts there (the calls that failed before
        # the breaker opened, and a little refill, come on top), not at a fresh 60
        assert sum(isinstance(o, Grant) for o in outcomes) <= 10 + 3 + 2
        await store.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_first_requests_wait_for_the_first_connect_instead_of_a_local_share(redis_server):
    async def go():
        store = fallback(redis_server.url, BudgetLimits(requests_per_minute=3))
        tenant = f"fresh{time.time_ns()}"
        outcomes = [await timed_reserve(store, tenant) for _ in range(5)]
        # all decided by Redis: 3 granted there, none on a local share on top
        assert [isinstance(o, Grant) for o in outcomes] == [True] * 3 + [False] * 2
        assert store.num_local_reserves == 0
        assert int(redis_server.cli("hlen", tenant_keys(tenant)[2])) == 3
        await store.aclose()
    run(go())
