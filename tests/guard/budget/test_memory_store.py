"""The in-memory store's request path, exactly: what the reserve arguments check accepts, and
the bucket levels after grants, denials, settles, releases and refills (an injected clock)."""

from __future__ import annotations

import enum
import math

import pytest

from guard.budget.memory_store import MemoryStore, check_reserve_args
from guard.budget.store import BudgetLimits, Denied, Grant
from tests.support.admission import FakeClock


class _Tokens(int, enum.Enum):
    FIVE = 5


class _Name(str):
    pass


@pytest.mark.parametrize("tenant, tokens, lease_s", [
    ("a", 1, 0.001), ("a", 5, 30), ("a", _Tokens.FIVE, 30.0), (_Name("a"), 5, 30.0),
    ("a", 5, math.inf)])
def test_reserve_arguments_of_any_accepted_type_pass(tenant, tokens, lease_s):
    check_reserve_args(tenant, tokens, lease_s)


@pytest.mark.parametrize("tenant, tokens, lease_s", [
    ("", 5, 30.0), (None, 5, 30.0), ("a", 0, 30.0), ("a", True, 30.0), ("a", 5.0, 30.0),
    ("a", 5, 0.0), ("a", 5, -1.0), ("a", 5, math.nan), ("a", 5, True), ("a", 5, "30")])
def test_bad_reserve_arguments_raise(tenant, tokens, lease_s):
    with pytest.raises(ValueError, match="budget reserve"):
        check_reserve_args(tenant, tokens, lease_s)


def test_levels_after_grants_denials_settles_releases_and_refills():
    clock = FakeClock(1000.0)
    store = MemoryStore(lambda t: BudgetLimits(tokens_per_minute=600, requests_per_minute=3),
                        clock)
    first = store.reserve_now("a", 250, 30.0)
    second = store.reserve_now("a", 250, 30.0)
    assert isinstance(first, Grant) and isinstance(second, Grant)
    assert store.levels_now("a") == (100.0, 1.0)
    assert store.reserve_now("a", 101, 30.0) == Denied("tpm_limit", 0.1)  # 1 token short, at 10/s
    assert store.reserve_now("a", 601, 30.0) == Denied("tpm_limit", None)  # never fits
    assert store.levels_now("a") == (100.0, 1.0)  # denials charge nothing
    clock.advance(6.0)  # +60 tokens, +0.3 requests
    assert store.levels_now("a") == (160.0, 1.3)
    store.finish_soon(first, 50)  # settled: 200 of its 250 tokens back, not its request
    assert store.levels_now("a") == (360.0, 1.3)
    store.finish_soon(second, None)  # released: all of it back, its request too
    assert store.levels_now("a") == (600.0, 2.3)
    store.finish_soon(second, None)  # once per grant
    assert store.levels_now("a") == (600.0, 2.3)
    clock.advance(20.0)  # +200 tokens, +1 request: both past their limit
    assert store.levels_now("a") == (600.0, 3.0)  # full, never above the limit
    assert [isinstance(store.reserve_now("a", 1, 30.0), Grant) for _ in range(4)] == [
        True, True, True, False]
    assert store.levels_now("a") == (597.0, 0.0)


def test_an_unlimited_axis_stays_at_zero_and_a_concurrency_limit_holds():
    clock = FakeClock(0.0)
    store = MemoryStore(lambda t: BudgetLimits(max_concurrent=2), clock)
    grants = [store.reserve_now("a", 10**6, 5.0) for _ in range(2)]
    assert all(isinstance(g, Grant) for g in grants)
    assert store.reserve_now("a", 1, 5.0) == Denied("concurrency_limit", 1.0)
    assert store.levels_now("a") == (0.0, 0.0)
    clock.advance(5.0)  # both leases expired unrenewed: reclaimed by the next reserve
    assert isinstance(store.reserve_now("a", 1, 5.0), Grant) and store.num_leases("a") == 1
