"""Grants reserved ahead: the pool's rules with an injected clock, then a real redis-server —
far from the limit requests take held grants, near it Redis decides every one, a dead holder's
grants come back at lease expiry, and three guards admit one budget, all of it."""

from __future__ import annotations

import asyncio
import time

from budget_backends import RedisBackend
from redis_servers import RedisServer

from guard.budget.config import BudgetConfig
from guard.budget.fallback import FallbackStore
from guard.budget.grant_pool import BATCHES_AHEAD, HOLD_S, MARGIN, MIN_POOL, GrantPool
from guard.budget.keys import tenant_keys
from guard.budget.store import BudgetLimits, Denied, Grant
from tests.support.admission import FakeClock

BIG = BudgetLimits(tokens_per_minute=10_000_000, requests_per_minute=1_000_000)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


def pool(guards: int = 1) -> tuple[GrantPool, FakeClock]:
    clock = FakeClock(100.0)
    return GrantPool(clock, lambda: guards), clock


def test_wanted_only_far_from_the_limit_and_never_with_a_concurrency_limit():
    grants, _ = pool(guards=3)
    assert grants.wanted("a", BIG, (1e7, 1e6), 10) == 0  # no batch seen yet: no target
    grants.saw_batch("a", 2)
    target = BATCHES_AHEAD * 2
    assert grants.wanted("a", BIG, None, 10) == 0  # levels never seen
    assert grants.wanted("a", BIG, (1e7, 1e6), 10) == target
    need = MARGIN * target * 3  # what every guard could hold, MARGIN times
    assert grants.wanted("a", BIG, (need * 10, need), 10) == target
    assert grants.wanted("a", BIG, (need * 10 - 1, need), 10) == 0  # tokens too close
    assert grants.wanted("a", BIG, (need * 10, need - 1), 10) == 0  # requests too close
    slots = BudgetLimits(10_000_000, 1_000_000, max_concurrent=1000)
    assert grants.wanted("a", slots, (1e7, 1e6), 10) == 0
    assert grants.wanted("a", BudgetLimits(max_concurrent=5), (None, None), 10) == 0


def test_take_hands_out_fitting_grants_and_moves_old_ones_to_stale():
    grants, clock = pool()
    grants.saw_batch("a", 1)
    assert grants.wanted("a", BIG, (1e7, 1e6), 10) == max(MIN_POOL, BATCHES_AHEAD)
    for i in range(8):
        grants.add("a", f"g{i}", 10, lease_s=30.0)
    assert grants.held_amount("a") == (80, 8)
    assert grants.take("a", 11) is None  # too small: Redis decides
    assert grants.take("a", 10) == ("g0", 10)
    assert grants.take("a", 10) == ("g1", 10) and not grants.low("a")  # 6 of 8 left
    assert grants.take("a", 10) == ("g2", 10) and grants.low("a")  # 5 of 8: top up
    assert grants.wanted("a", BIG, (1e7, 1e6), 10) == 3
    clock.advance(HOLD_S)
    assert grants.take("a", 5) is None
    assert grants.stale == [("a", f"g{i}") for i in range(3, 8)] and grants.num_held("a") == 0
    grants.stale.clear()
    grants.add("a", "g8", 10, lease_s=30.0)
    clock.advance(HOLD_S / 2)
    assert grants.expired() == {}
    clock.advance(HOLD_S / 2)
    assert grants.expired() == {"a": ["g8"]}


def test_grants_added_in_one_call_are_held_in_order_from_one_reading_of_the_clock():
    grants, clock = pool()
    grants.add_many("a", [], 10, lease_s=30.0)
    assert grants.tenants() == [] and grants.num_reserved == 0  # nothing: no entry
    grants.add("a", "g0", 10, lease_s=30.0)
    clock.advance(0.5)
    grants.add_many("a", (f"g{i}" for i in range(1, 4)), 12, lease_s=30.0)
    assert grants.num_reserved == 4 and grants.held_amount("a") == (46, 4)
    assert grants.take("a", 11) is None  # the oldest first: g0 is too small, Redis decides
    grants.add_many("b", ["h0"], 10, lease_s=30.0)
    clock.advance(HOLD_S - 0.5)  # g0 is HOLD_S old, g1..g3 half of it
    assert grants.take("a", 11) == ("g1", 12) and grants.stale == [("a", "g0")]
    clock.advance(0.5)  # g2, g3 and h0 are HOLD_S old, all from one reading
    assert grants.expired() == {"a": ["g2", "g3"], "b": ["h0"]}


def test_a_grant_is_never_held_past_a_third_of_its_lease():
    grants, clock = pool()
    grants.add("a", "short", 10, lease_s=0.9)
    clock.advance(0.31)  # past a third of 0.9 s: its holder could not renew it in time
    assert grants.take("a", 10, max_age_s=10.0) is None and grants.stale == [("a", "short")]


def test_far_from_the_limit_requests_take_grants_reserved_ahead_and_settle_them(redis_server):
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        store, tenant = await backend.store(BIG), backend.tenant()
        first = await asyncio.gather(*(store.reserve(tenant, 10, 30.0) for _ in range(4)))
        assert all(isinstance(g, Grant) for g in first)  # levels now known
        await asyncio.gather(*(store.reserve(tenant, 10, 30.0) for _ in range(4)))
        held = store.pool.num_held(tenant)
        assert held == BATCHES_AHEAD * 4  # the batch of 4, each of 1.5 × 10 + 1 tokens
        taken = [store.reserve_now(tenant, 12, 30.0) for _ in range(held)]
        assert all(isinstance(g, Grant) and g.tokens == 16 for g in taken)
        assert store.reserve_now(tenant, 12, 30.0) is None  # empty (a top-up is on its way)
        for grant in taken:  # every one is a grant Redis holds
            assert redis_server.cli("hget", tenant_keys(tenant)[2], grant.grant_id).strip() == "16"
        for grant in (*first, *taken):
            store.finish_soon(grant, 3)
        await asyncio.sleep(0.05)  # the top-up lands
        store.release_held()
        await store.flush()
        # settled and released grants are gone from Redis: only the second 4 are held
        assert int(redis_server.cli("hlen", tenant_keys(tenant)[2])) == 4
        await store.aclose()
    run(go())


def test_near_the_limit_every_decision_is_redis_own(redis_server):
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        store, tenant = await backend.store(BudgetLimits(requests_per_minute=100)), backend.tenant()
        outcomes = []
        for _ in range(30):  # batches of 4: a pool of 32 would need MARGIN × 32 left
            outcomes += await asyncio.gather(*(store.reserve(tenant, 1, 30.0) for _ in range(4)))
        assert sum(isinstance(o, Grant) for o in outcomes) == 100
        assert store.pool.num_reserved == 0
        await store.aclose()
    run(go())


def test_a_dead_holders_grants_come_back_at_lease_expiry(redis_server):
    backend = RedisBackend("redis", redis_server.url)

    async def go():
        store, tenant = await backend.store(BIG), backend.tenant()
        for _ in range(2):
            await asyncio.gather(*(store.reserve(tenant, 10, 0.6) for _ in range(4)))
        assert store.pool.num_held(tenant) == BATCHES_AHEAD * 4
        await store.client.aclose()  # dies: nothing released, nothing renewed
        await asyncio.sleep(0.8)
        other = await backend.store(BIG)
        assert isinstance(await other.reserve(tenant, 10, 30.0), Grant)
        assert int(redis_server.cli("hlen", tenant_keys(tenant)[2])) == 1  # the rest reclaimed
        await other.aclose()
    run(go())


def test_three_guards_far_then_near_the_limit_admit_the_budget_exactly():
    """Three guards with a budget of 2,000 requests, 3,000 asked in rounds: they pool while
    far from the limit and stop near it, and every grant held ahead goes back — so they admit
    2,000 (and what refilled), no more and no fewer."""
    server = RedisServer().start()
    config = BudgetConfig(heartbeat_s=0.2, lease_s=5.0, retry_max_s=0.3, redis_timeout_s=1.0)
    limits = BudgetLimits(requests_per_minute=2000)

    async def go():
        guards = [FallbackStore(server.url, lambda t: limits, config, time.monotonic)
                  for _ in range(3)]
        for guard in guards:
            await guard.open()
        start_s = time.monotonic()
        admitted = 0
        for _ in range(60):
            outcomes = await asyncio.gather(*(guards[i % 3].reserve("acme", 1, 5.0)
                                              for i in range(50)))
            admitted += sum(isinstance(o, Grant) for o in outcomes)
            assert all(isinstance(o, (Grant, Denied)) for o in outcomes)
            await asyncio.sleep(0.03)
        assert sum(g.redis.pool.num_taken for g in guards) > 0  # pooled while far
        await asyncio.sleep(HOLD_S + 0.5)  # grants held at the end go back
        for _ in range(10):
            outcomes = await asyncio.gather(*(guards[i % 3].reserve("acme", 1, 5.0)
                                              for i in range(30)))
            admitted += sum(isinstance(o, Grant) for o in outcomes)
        refill = 2000 * (time.monotonic() - start_s) / 60 + 1
        assert 2000 <= admitted <= 2000 + refill
        for guard in guards:
            await guard.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_grants_held_by_an_idle_guard_go_back_within_a_heartbeat_of_hold_s(redis_server):
    config = BudgetConfig(heartbeat_s=0.2, lease_s=5.0, redis_timeout_s=1.0)

    async def go():
        guard = FallbackStore(redis_server.url, lambda t: BIG, config, time.monotonic)
        await guard.open()
        tenant = f"idle{time.time_ns()}"
        for _ in range(2):
            await asyncio.gather(*(guard.reserve(tenant, 10, 5.0) for _ in range(4)))
        assert guard.redis.pool.num_held(tenant) == BATCHES_AHEAD * 4
        assert int(redis_server.cli("hlen", tenant_keys(tenant)[2])) == 8 + BATCHES_AHEAD * 4
        deadline = time.monotonic() + HOLD_S + 5.0
        while int(redis_server.cli("hlen", tenant_keys(tenant)[2])) != 8:  # the 8 requests'
            assert time.monotonic() < deadline, "held grants never went back"
            await asyncio.sleep(0.05)
        assert guard.redis.pool.num_held(tenant) == 0
        await guard.aclose()
    run(go())
