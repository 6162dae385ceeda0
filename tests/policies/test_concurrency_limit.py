"""The learned concurrency limit: AIMD on first tokens, gaps and failures (pure, table-tested)."""

import pytest

from policies.concurrency_limit import GOOD, IGNORED, OVERLOADED, ConcurrencyLimit, LimitSample


def good(now_s: float, num_inflight: int) -> LimitSample:
    return LimitSample(GOOD, now_s - 1.0, now_s, num_inflight)


def overloaded(dispatch_s: float, now_s: float) -> LimitSample:
    return LimitSample(OVERLOADED, dispatch_s, now_s, 1)


def test_grows_about_one_per_limit_of_good_samples_at_the_limit():
    limit = ConcurrencyLimit(initial_limit=4)
    for i in range(4):
        limit.update(good(float(i), num_inflight=4))
    assert limit.value == 4 and limit.limit == pytest.approx(4.9, abs=0.05)
    limit.update(good(5.0, num_inflight=4))
    assert limit.value == 5


def test_does_not_grow_on_samples_from_a_replica_below_its_limit():
    limit = ConcurrencyLimit(initial_limit=4)
    for i in range(50):
        limit.update(good(float(i), num_inflight=2))
    assert limit.limit == 4.0


def test_cuts_multiplicatively_once_per_episode():
    limit = ConcurrencyLimit(initial_limit=10, backoff_ratio=0.5)
    assert limit.update(overloaded(dispatch_s=1.0, now_s=2.0)) == 5
    # dispatched before the cut at 2.0: sent under the old limit, no second cut
    assert limit.update(overloaded(dispatch_s=1.5, now_s=2.1)) == 5
    assert limit.update(overloaded(dispatch_s=2.05, now_s=3.0)) == 2  # 2.5
    assert limit.num_cuts == 2


def test_never_below_min_limit_and_ignored_samples_change_nothing():
    limit = ConcurrencyLimit(initial_limit=2)
    for i in range(10):
        limit.update(overloaded(dispatch_s=float(i), now_s=float(i) + 0.5))
    assert limit.value == 1 and limit.limit == 1.0
    limit.update(LimitSample(IGNORED, 20.0, 21.0, 1))
    assert limit.limit == 1.0


def test_probes_of_a_failed_level_grow_rarer_and_a_held_probe_resets():
    limit = ConcurrencyLimit(initial_limit=2, backoff_ratio=0.5)
    limit.update(overloaded(0.0, 0.5))  # 2 -> 1, level 2 failed
    now_s = 1.0
    gaps = []
    for _ in range(4):  # each probe of 2 fails again: the growth into 2 halves each time
        n = 0
        while limit.value < 2:
            limit.update(good(now_s, num_inflight=1))
            now_s += 1.0
            n += 1
        gaps.append(n)
        limit.update(overloaded(now_s, now_s + 0.5))
        now_s += 1.0
    assert gaps == [3, 6, 12, 24]  # probe scale 1/2, 1/4, 1/8, 1/16 of 1 / limit a sample
    while limit.value < 2:
        limit.update(good(now_s, num_inflight=1))
        now_s += 1.0
    limit.update(good(now_s, num_inflight=2))  # the probe held: 2 is fine after all
    assert limit.failed_level is None and limit.probe_scale == 1.0


@pytest.mark.parametrize("kwargs", [
    {"min_limit": 0}, {"initial_limit": 0.5}, {"max_limit": 0.5},
    {"backoff_ratio": 1.0}, {"backoff_ratio": 0.0},
    {"first_probe_scale": 0.0}, {"min_probe_scale": 0.9, "first_probe_scale": 0.5},
])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        ConcurrencyLimit(**kwargs)


def test_an_unknown_signal_is_refused_and_changes_nothing():
    limit = ConcurrencyLimit(initial_limit=3)
    with pytest.raises(ValueError, match="signal must be one of"):
        limit.update(LimitSample("slow", 0.0, 1.0, 3))
    assert limit.limit == 3.0
