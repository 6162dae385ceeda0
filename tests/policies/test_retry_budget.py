"""RetryBudget table tests: a 10 s window of 1 s buckets, time passed in (no clock, no sleep)."""

import pytest

from policies.retry_budget import RetryBudget, RetryBudgetConfig, RetryBudgetView


def budget(ratio=0.10, window_s=10.0, min_retries=0):
    return RetryBudget(RetryBudgetConfig(ratio, window_s, min_retries))


def arrive(b, tenant, num_first, num_retries, now_s=0.0):
    for _ in range(num_first):
        b.record(tenant, False, now_s)
    for _ in range(num_retries):
        b.record(tenant, True, now_s)


@pytest.mark.parametrize(
    ("num_first", "num_retries", "over", "advise"),
    [
        (100, 0, False, True),  # no retries yet: a shed says "retry after X"
        (100, 5, False, True),  # under the 10 % budget: wait advised
        (100, 9, False, True),  # one retry left in the budget
        (100, 10, False, False),  # at the budget: not over, but no room for another
        (100, 11, True, False),  # over: retries are shed first and told not to retry
        (0, 1, True, False),  # retries with no first attempts at all
    ],
)
def test_advice_and_over_budget_follow_the_share_of_retries(num_first, num_retries, over, advise):
    b = budget()
    arrive(b, "acme", num_first, num_retries)
    assert b.is_over("acme", 1.0) is over
    assert b.advise_retry("acme", 1.0) is advise


def test_advised_retries_use_the_budget_at_once_so_advice_never_overpromises():
    b = budget()
    arrive(b, "acme", 100, 0)
    advice = [b.advise_retry("acme", 1.0) for _ in range(15)]
    assert advice == [True] * 10 + [False] * 5
    assert b.counts("acme", 1.0) == (100, 0, 10)
    # The advised clients come back: those retries are within the budget, not over it.
    arrive(b, "acme", 0, 10, now_s=2.0)
    assert not b.is_over("acme", 2.0)
    assert not b.advise_retry("acme", 2.0)


def test_advice_recovers_when_load_falls_and_the_window_slides_past_the_retries():
    b = budget()
    arrive(b, "acme", 100, 30, now_s=0.0)  # a retry storm
    assert b.is_over("acme", 0.5) and not b.advise_retry("acme", 0.5)
    for t in range(1, 10):  # load falls: a few first attempts per second, no retries
        arrive(b, "acme", 3, 0, now_s=float(t))
    assert b.is_over("acme", 9.5)  # the storm is still inside the 10 s window
    arrive(b, "acme", 3, 0, now_s=10.0)  # second 0 has left the window: 30 first attempts
    assert not b.is_over("acme", 10.0)
    assert b.advise_retry("acme", 10.0)  # "retry after X" again
    assert b.counts("acme", 10.0) == (30, 0, 1)


def test_each_tenant_has_its_own_budget_and_the_guard_one_over_all():
    b = budget()
    arrive(b, "storm", 10, 5)  # over its own budget
    arrive(b, "calm", 200, 0)  # keeps the global share at 5 / 210 (under 10 %)
    assert b.view(0.0) == RetryBudgetView(frozenset({"storm"}), over_global=False)
    assert b.is_over("storm", 0.0) and not b.is_over("calm", 0.0)
    assert not b.advise_retry("storm", 0.0) and b.advise_retry("calm", 0.0)
    arrive(b, "storm", 0, 30)  # now over globally too: 35 retries for 210 first attempts
    assert b.view(0.0).over_global
    assert b.is_over("calm", 0.0) and not b.advise_retry("calm", 0.0)


def test_min_retries_lets_a_quiet_tenant_retry_a_few_times():
    b = budget(min_retries=2)
    arrive(b, "acme", 3, 0)  # 10 % of 3 is 0.3: without the floor no retry would be allowed
    assert [b.advise_retry("acme", 0.0) for _ in range(3)] == [True, True, False]
    arrive(b, "acme", 0, 2)
    assert not b.is_over("acme", 0.0)
    arrive(b, "acme", 0, 1)
    assert b.is_over("acme", 0.0)


def test_budget_ratio_is_configurable():
    b = budget(ratio=0.5)
    arrive(b, "acme", 10, 5)
    assert not b.is_over("acme", 0.0)
    b.record("acme", True, 0.0)
    assert b.is_over("acme", 0.0)


def test_view_is_cached_until_a_record_or_a_new_bucket():
    b = budget()
    arrive(b, "acme", 0, 1)
    v = b.view(0.0)
    assert b.view(0.05) is v and v.is_over("acme")
    assert not b.view(10.5).is_over("acme")  # the retry left the window


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget_ratio": -0.1},
        {"budget_ratio": 1.5},
        {"window_s": 0.0},
        {"min_retries": -1},
        {"min_retries": 1.5},
        {"min_retries": True},
    ],
)
def test_bad_config_is_a_value_error(kwargs):
    with pytest.raises(ValueError):
        RetryBudgetConfig(**kwargs)


def test_cached_view_always_equals_a_rebuilt_one():
    """The view is kept across records unless one flips a tenant's or the guard's state; it must
    equal the view rebuilt from scratch after every step of a mixed sequence."""
    import random

    rng = random.Random(7)
    cached, rebuilt = budget(min_retries=1), budget(min_retries=1)
    now_s = 0.0
    num_over = 0
    for _ in range(3000):
        now_s += rng.choice((0.0, 0.01, 0.3, 2.5))
        tenant, step, is_retry = rng.choice(("a", "b", "c")), rng.random(), rng.random() < 0.3
        for b in (cached, rebuilt):
            if step < 0.7:
                b.record(tenant, is_retry, now_s)
            elif step < 0.85:
                b.advise_retry(tenant, now_s)
        rebuilt._view = None
        view = cached.view(now_s)
        assert view == rebuilt.view(now_s), now_s
        num_over += bool(view.over_tenants)
    assert 0 < num_over < 3000  # the sequence did cross the budget both ways


@pytest.mark.parametrize("storm_share", [0.3, 0.6])
def test_the_cached_view_matches_a_fresh_one_after_every_record(storm_share):
    """The view is kept across records that change no verdict; it must always equal the one a
    new budget fed the same arrivals would build (a calm tenant's first attempts flip the
    global verdict without changing its own)."""
    import random

    rng = random.Random(7)
    b = budget(min_retries=1)
    arrivals = []
    for i in range(600):  # a storming tenant's bursts of retries among calm first attempts
        storming = (i // 40) % 2 and rng.random() < 0.5
        tenant = "storm" if storming else rng.choice(["calm", "quiet"])
        arrivals.append((tenant, storming and rng.random() < storm_share, i * 0.01))
        b.record(*arrivals[-1])
        if i % 2 == 0:
            fresh = budget(min_retries=1)
            for arrival in arrivals:
                fresh.record(*arrival)
            now_s = arrivals[-1][2]
            assert b.view(now_s) == fresh.view(now_s)
