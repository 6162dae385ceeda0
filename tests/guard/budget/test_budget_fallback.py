"""Redis trouble never takes the guard down: a real redis-server the test kills, stops, restarts."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from redis_servers import RedisServer, free_port

from guard.budget.config import BudgetConfig
from guard.budget.fallback import STARTUP_WAIT_S, FallbackStore
from guard.budget.keys import LIVE_GUARDS_KEY, tenant_keys
from guard.budget.metrics import BudgetMetrics
from guard.budget.store import BudgetLimits, Denied, Grant

SETTINGS = dict(heartbeat_s=0.2, lease_s=5.0, retry_max_s=0.3, breaker_failures=3,
                redis_timeout_s=0.05)
HANG_GUARD_S = 2.0  # far above the 50 ms Redis timeout: only catches a request stuck on Redis


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


def run_then_kill(server, go) -> None:
    """Run the test body ``go()`` to its end; the Redis server is killed whatever happened."""
    try:
        run(go())
    finally:
        server.kill()


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
    run_then_kill(server, go)


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
    run_then_kill(server, go)


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
    run_then_kill(server, go)


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
    run_then_kill(server, go)


def test_grants_made_locally_are_settled_locally_and_charged_to_a_restarted_redis_once():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(tokens_per_minute=10_000))
        await until(lambda: store.backend == "redis")
        start_s = time.monotonic()
        server.kill()
        local = [await timed_reserve(store, "acme", 100) for _ in range(5)]
        assert all(isinstance(g, Grant) for g in local) and store.backend == "local"
        server.start()  # empty: its bucket for acme is full again
        await until(lambda: store.backend == "redis")
        for grant in local:
            await store.settle(grant, 50)
        await store.redis.flush()
        assert store.local.num_leases("acme") == 0
        # no lease or grant in Redis; its bucket carries what was used locally, once: 5 × 100
        # reserved at recovery, the unused 5 × 50 given back at settle
        bucket, leases, grants = tenant_keys("acme")
        assert server.cli("exists", leases, grants).strip() == "0"
        level = float(server.cli("hget", bucket, "tl"))
        assert 10_000 - 250 - 1 <= level <= 10_000 - 250 + refill(10_000, start_s)
        await store.aclose()
    run_then_kill(server, go)


def refill(per_minute: int, since_s: float) -> float:
    return per_minute * (time.monotonic() - since_s) / 60 + 1


def test_hung_redis_gets_the_local_decisions_charged_once_on_sigcont():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(requests_per_minute=60))
        await until(lambda: store.backend == "redis")
        start_s = time.monotonic()
        assert all([isinstance(await timed_reserve(store, "acme"), Grant) for _ in range(30)])
        server.signal(signal.SIGSTOP)
        try:
            outcomes = [await timed_reserve(store, "acme") for _ in range(60)]
            assert store.backend == "local"
        finally:
            server.signal(signal.SIGCONT)
        local = sum(isinstance(o, Grant) for o in outcomes)
        # the share starts from the 30 Redis had left (a reserve that timed out may still
        # have been granted in Redis: it is released again, not kept)
        assert 30 - 1 <= local <= 30 + refill(60, start_s)
        await until(lambda: store.backend == "redis")
        await store.redis.flush()
        # Redis kept its state: it was charged the local grants, once (nothing left to give)
        after = [await timed_reserve(store, "acme") for _ in range(10)]
        assert sum(isinstance(o, Grant) for o in after) <= refill(60, start_s)
        assert {o.reason for o in after if isinstance(o, Denied)} == {"rpm_limit"}
        await store.aclose()
    run_then_kill(server, go)


def test_killed_redis_restarted_empty_does_not_grant_a_fresh_window():
    server = RedisServer().start()

    async def go():
        store = fallback(server.url, BudgetLimits(requests_per_minute=60))
        await until(lambda: store.backend == "redis")
        start_s = time.monotonic()
        assert all([isinstance(await timed_reserve(store, "acme"), Grant) for _ in range(50)])
        server.kill()
        outcomes = [await timed_reserve(store, "acme") for _ in range(5)]
        assert all(isinstance(o, Grant) for o in outcomes) and store.backend == "local"
        server.start()  # empty: a fresh bucket of 60
        await until(lambda: store.backend == "redis")
        after = [await timed_reserve(store, "acme") for _ in range(20)]
        # 55 of 60 spent before and during the outage: about 5 left, not 60
        assert sum(isinstance(o, Grant) for o in after) <= 5 + refill(60, start_s)
        await store.aclose()
    run_then_kill(server, go)


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
    run_then_kill(server, go)


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
    run_then_kill(server, go)


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


class Staller:
    """Makes a live Redis slow, not dead: SIGSTOP for ``stall_s``, SIGCONT for ``run_s``, over
    and over (a server stalled by a fork or a slow disk answers everything, late)."""

    def __init__(self, server: RedisServer, stall_s: float = 0.08, run_s: float = 0.04) -> None:
        self._server, self._stall_s, self._run_s = server, stall_s, run_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._server.signal(signal.SIGSTOP)
            self._stop.wait(self._stall_s)
            self._server.signal(signal.SIGCONT)
            self._stop.wait(self._run_s)

    def __enter__(self) -> Staller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._server.signal(signal.SIGCONT)


def test_slow_redis_flapping_the_breaker_never_over_admits_and_redis_comes_back():
    server = RedisServer().start()

    async def go():
        limits = BudgetLimits(requests_per_minute=60)
        guards = [fallback(server.url, limits) for _ in range(3)]
        await until(lambda: all(g.backend == "redis" and g.live_guards == 3 for g in guards))
        start_s = time.monotonic()
        # each guard has served the tenant: it knows what Redis has left
        granted = sum([isinstance(await timed_reserve(g, "acme"), Grant) for g in guards])
        with Staller(server, stall_s=0.25, run_s=0.1):
            for _ in range(60):  # paced over a few stalls: the breakers open and close
                step = await asyncio.gather(*(timed_reserve(g, "acme") for g in guards))
                granted += sum(isinstance(o, Grant) for o in step)
                await asyncio.sleep(0.03)
        await until(lambda: all(g.backend == "redis" for g in guards))
        for guard in guards:
            await guard.redis.flush()
        after = [await timed_reserve(guards[i % 3], "acme") for i in range(30)]
        assert sum(g.breaker.num_opens for g in guards) >= 2  # the slow calls tripped it
        # every grant, Redis's or a local share's, came out of the one shared bucket
        assert granted <= 1.1 * 60 + refill(60, start_s)
        assert granted + sum(isinstance(o, Grant) for o in after) <= 1.1 * 60 + refill(60, start_s)
        for guard in guards:
            await guard.aclose()
    run_then_kill(server, go)


def test_heartbeats_refresh_what_an_idle_guard_knows_is_left(redis_server):
    async def go():
        limits = BudgetLimits(requests_per_minute=60)
        tenant = f"idle{time.time_ns()}"
        idle, busy = fallback(redis_server.url, limits), fallback(redis_server.url, limits)
        await until(lambda: idle.backend == "redis" and busy.backend == "redis")
        assert isinstance(await timed_reserve(idle, tenant), Grant)
        assert idle.redis.levels[tenant][1] >= 58
        for _ in range(30):
            assert isinstance(await timed_reserve(busy, tenant), Grant)
        # the idle guard made no call for the tenant: its heartbeat reads the level again
        await until(lambda: idle.redis.levels[tenant][1] <= 35)  # 29 left, plus refill
        await idle.aclose()
        await busy.aclose()
    run(go())


@pytest.mark.parametrize("redis_at_start", ["hung", "absent"])
def test_guards_started_without_redis_admit_one_budget_and_pay_it_once_redis_answers(
        redis_at_start):
    """Three guards open their link while Redis is SIGSTOPped (or not running yet): start-up
    is not held past its window, and never having seen a heartbeat each decides on
    limit ÷ expected_guards, not the whole limit; once Redis answers each charges it what it
    admitted, so the shared bucket holds what is left of one budget."""
    server = RedisServer(port=free_port())
    if redis_at_start == "hung":
        server.start().signal(signal.SIGSTOP)

    async def go():
        guards = [fallback(server.url, BudgetLimits(requests_per_minute=30), expected_guards=3)
                  for _ in range(3)]
        start_s = time.monotonic()
        await asyncio.gather(*(g.open() for g in guards))
        assert time.monotonic() - start_s < STARTUP_WAIT_S + HANG_GUARD_S  # start-up not held
        assert not any(g.ever_reached for g in guards)
        assert {g.backend for g in guards} == {"local"}
        admitted = 0
        for guard in guards:
            outcomes = [await timed_reserve(guard, "acme") for _ in range(20)]
            admitted += sum(isinstance(o, Grant) for o in outcomes)
        refill = int(30 * (time.monotonic() - start_s) / 60) + 1
        assert 30 <= admitted <= 30 + refill  # one budget across the three, not one each
        if redis_at_start == "hung":
            server.signal(signal.SIGCONT)
        else:
            server.start()
        await until(lambda: all(g.backend == "redis" for g in guards))
        left = float(server.cli("hget", tenant_keys("acme")[0], "rl"))
        assert left <= 30 - admitted + refill  # each guard's local admissions charged once
        for guard in guards:
            await guard.aclose()
    run_then_kill(server, go)


def test_open_connects_before_any_request_and_heartbeats(redis_server):
    async def go():
        store = fallback(redis_server.url, BudgetLimits(requests_per_minute=30))
        await store.open()
        assert store.backend == "redis" and store.ever_reached
        assert store.num_local_reserves == 0
        assert redis_server.cli("zscore", LIVE_GUARDS_KEY, store.instance_id).strip()
        await store.aclose()
    run(go())
