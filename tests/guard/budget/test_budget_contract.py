"""The budget store contract, one suite for the memory store, one Redis and a 3-master Cluster.

Limits are per minute and refill continuously, so a Redis test (real time) sees a few tokens come
back while it runs: the amounts below leave margins of tens of tokens for that.
"""

from __future__ import annotations

import asyncio

import pytest
from budget_backends import MemoryBackend, RedisBackend

from guard.budget.store import BudgetLimits, Denied, Grant


@pytest.fixture(params=["memory", "redis", "cluster"])
def backend(request):
    if request.param == "memory":
        return MemoryBackend()
    if request.param == "redis":
        return RedisBackend("redis", request.getfixturevalue("redis_server").url)
    return RedisBackend("cluster", request.getfixturevalue("redis_cluster").url)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


TPM = BudgetLimits(tokens_per_minute=1000)


def test_grant_within_the_limit_and_never_above_it(backend):
    async def go():
        store, tenant = await backend.store(TPM), backend.tenant()
        grant = await store.reserve(tenant, 400, 30.0)
        assert isinstance(grant, Grant) and grant.tokens == 400 and grant.tenant == tenant
        assert await store.reserve(tenant, 1001, 30.0) == Denied("tpm_limit", None)
        await store.aclose()
    run(go())


def test_exhausted_tokens_denied_with_retry_after_from_the_bucket(backend):
    async def go():
        store, tenant = await backend.store(TPM), backend.tenant()
        assert isinstance(await store.reserve(tenant, 900, 30.0), Grant)
        denied = await store.reserve(tenant, 500, 30.0)
        assert isinstance(denied, Denied) and denied.reason == "tpm_limit"
        # 400 tokens missing at 1000/min: about 24 s (less what refilled meanwhile)
        assert 20.0 <= denied.retry_after_s <= 24.0
        # a denial charges nothing: a request that fits the remaining ~100 still fits
        assert isinstance(await store.reserve(tenant, 60, 30.0), Grant)
        await store.aclose()
    run(go())


def test_settle_refunds_the_unused_part(backend):
    async def go():
        store, tenant = await backend.store(TPM), backend.tenant()
        grant = await store.reserve(tenant, 800, 30.0)
        assert isinstance(await store.reserve(tenant, 800, 30.0), Denied)
        await store.settle(grant, 100)
        assert isinstance(await store.reserve(tenant, 800, 30.0), Grant)  # 900 back, 800 fits
        assert isinstance(await store.reserve(tenant, 150, 30.0), Denied)  # only ~100 left
        await store.aclose()
    run(go())


def test_release_refunds_tokens_and_the_request(backend):
    async def go():
        limits = BudgetLimits(tokens_per_minute=1000, requests_per_minute=2)
        store, tenant = await backend.store(limits), backend.tenant()
        first = await store.reserve(tenant, 900, 30.0)
        assert isinstance(await store.reserve(tenant, 50, 30.0), Grant)
        denied = await store.reserve(tenant, 10, 30.0)
        assert denied.reason == "rpm_limit" and 0 < denied.retry_after_s <= 30.0
        await store.release(first)
        assert isinstance(await store.reserve(tenant, 900, 30.0), Grant)
        await store.aclose()
    run(go())


def test_settle_keeps_the_request_counted(backend):
    async def go():
        store, tenant = await backend.store(BudgetLimits(requests_per_minute=2)), backend.tenant()
        await store.settle(await store.reserve(tenant, 10, 30.0), 10)
        assert isinstance(await store.reserve(tenant, 10, 30.0), Grant)
        assert (await store.reserve(tenant, 10, 30.0)).reason == "rpm_limit"
        await store.aclose()
    run(go())


def test_max_concurrent_slots_free_on_settle_or_release(backend):
    async def go():
        store, tenant = await backend.store(BudgetLimits(max_concurrent=2)), backend.tenant()
        a = await store.reserve(tenant, 5, 30.0)
        b = await store.reserve(tenant, 5, 30.0)
        denied = await store.reserve(tenant, 5, 30.0)
        assert denied.reason == "concurrency_limit" and denied.retry_after_s is not None
        await store.settle(a, 3)
        c = await store.reserve(tenant, 5, 30.0)
        assert isinstance(c, Grant)
        await store.release(b)
        assert isinstance(await store.reserve(tenant, 5, 30.0), Grant)
        await store.aclose()
    run(go())


def test_settle_and_release_are_idempotent(backend):
    async def go():
        store, tenant = await backend.store(TPM), backend.tenant()
        grant = await store.reserve(tenant, 600, 30.0)
        await store.settle(grant, 600)
        await store.settle(grant, 0)      # no second refund
        await store.release(grant)        # nor a late release
        assert isinstance(await store.reserve(tenant, 500, 30.0), Denied)
        await store.aclose()
    run(go())


def test_expired_lease_is_reclaimed_and_renewed_lease_is_not(backend):
    async def go():
        limits = BudgetLimits(tokens_per_minute=1000, max_concurrent=2)
        store, tenant = await backend.store(limits), backend.tenant()
        kept = await store.reserve(tenant, 400, 0.6)
        lost = await store.reserve(tenant, 400, 0.6)
        assert isinstance(lost, Grant)
        await backend.advance(0.3)
        await store.renew([kept], 30.0)
        await backend.advance(0.5)        # `lost` expired, `kept` renewed
        again = await store.reserve(tenant, 450, 30.0)   # its slot and its 400 tokens came back
        assert isinstance(again, Grant)
        assert (await store.reserve(tenant, 5, 30.0)).reason == "concurrency_limit"
        await store.settle(lost, 400)     # too late: a no-op, nothing charged twice
        await store.release(again)
        assert isinstance(await store.reserve(tenant, 550, 30.0), Grant)
        await store.aclose()
    run(go())


def test_bad_arguments_raise_and_charge_nothing(backend):
    async def go():
        store, tenant = await backend.store(BudgetLimits(requests_per_minute=1)), backend.tenant()
        for tokens, lease_s, who in ((0, 1.0, tenant), (-5, 1.0, tenant), (1.5, 1.0, tenant),
                                     (True, 1.0, tenant), (5, 0, tenant), (5, 1.0, "")):
            with pytest.raises(ValueError):
                await store.reserve(who, tokens, lease_s)
        assert isinstance(await store.reserve(tenant, 5, 30.0), Grant)
        await store.aclose()
    run(go())


def test_tenants_are_isolated_whatever_their_names(backend):
    async def go():
        names = [backend.tenant(base) for base in ("a{b}:c ", "x-", "ünï", "plain")]
        store = await backend.store(BudgetLimits(requests_per_minute=1))
        for name in names:
            assert isinstance(await store.reserve(name, 5, 30.0), Grant)
        for name in names:
            assert (await store.reserve(name, 5, 30.0)).reason == "rpm_limit"
        await store.aclose()
    run(go())


def test_unlimited_tenant_always_granted(backend):
    async def go():
        store, tenant = await backend.store(BudgetLimits()), backend.tenant()
        grants = [await store.reserve(tenant, 10**6, 30.0) for _ in range(5)]
        assert all(isinstance(g, Grant) for g in grants)
        await store.aclose()
    run(go())


def test_simultaneous_reserves_never_over_admit(backend):
    async def go():
        limits = BudgetLimits(requests_per_minute=10, max_concurrent=50)
        store, tenant = await backend.store(limits), backend.tenant()
        outcomes = await asyncio.gather(*(store.reserve(tenant, 5, 30.0) for _ in range(60)))
        assert sum(isinstance(o, Grant) for o in outcomes) == 10
        assert {o.reason for o in outcomes if isinstance(o, Denied)} == {"rpm_limit"}
        await store.aclose()
    run(go())


def test_remaining_is_what_the_grants_left(backend):
    """What the x-ratelimit-remaining-* headers report: per axis, the budget left after the
    grants (refilling at the limit's rate: Redis runs in real time, hence the margins); None
    on an unlimited axis."""
    async def go():
        limits = BudgetLimits(tokens_per_minute=1000, requests_per_minute=10)
        store, tenant = await backend.store(limits), backend.tenant()
        assert isinstance(await store.reserve(tenant, 300, 30.0), Grant)
        assert isinstance(await store.reserve(tenant, 200, 30.0), Grant)
        tokens, requests = store.remaining_now(tenant)
        assert 500.0 <= tokens <= 520.0 and 8.0 <= requests <= 8.2
        other = backend.tenant()
        store_tpm = await backend.store(BudgetLimits(tokens_per_minute=1000))
        assert isinstance(await store_tpm.reserve(other, 100, 30.0), Grant)
        tokens, requests = store_tpm.remaining_now(other)
        assert 900.0 <= tokens <= 920.0 and requests is None
        await store.aclose()
        await store_tpm.aclose()
    run(go())
