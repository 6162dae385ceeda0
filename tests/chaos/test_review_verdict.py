"""The review's verdict logic on synthetic per-seed samples."""

import random

import pytest

from chaos.review_verdict import BETTER, SAME, WORSE, bootstrap_mean, combine, compare


def _noisy(mean, sd, n, seed):
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_same_distribution_is_no_significant_change_in_almost_every_trial():
    same = 0
    for trial in range(100):
        base = _noisy(10.0, 0.3, 5, f"b{trial}")
        cand = _noisy(10.0, 0.3, 5, f"c{trial}")
        same += compare("goodput_ratio", base, cand).verdict == SAME
    assert same >= 95


def test_clearly_better_and_clearly_worse():
    base = _noisy(10.0, 0.2, 5, "b")
    assert compare("goodput_ratio", base, [x * 1.3 for x in base]).verdict == BETTER
    assert compare("goodput_ratio", base, [x * 0.7 for x in base]).verdict == WORSE
    # lower is better for latency and cost
    assert compare("ttft_p90_s", base, [x * 0.7 for x in base]).verdict == BETTER
    assert compare("cost_per_good_request_usd", base, [x * 1.3 for x in base]).verdict == WORSE


def test_a_consistent_but_tiny_change_is_no_change():
    base = [1.0, 1.1, 0.9, 1.05]
    verdict = compare("good_tokens_per_s", base, [x * 1.01 for x in base])
    assert verdict.relative_change.excludes_zero() and verdict.verdict == SAME


def test_undefined_seeds_are_dropped_and_all_undefined_is_no_change():
    v = compare("cost_per_good_request_usd", [None, 1.0, 1.0], [2.0, 2.0, 2.1])
    assert v.num_pairs == 2 and v.verdict == WORSE
    none = compare("cost_per_good_request_usd", [None, None], [None, 1.0])
    assert none.num_pairs == 0 and none.verdict == SAME and none.to_dict()["baseline"] is None


def test_combine_and_bad_input():
    assert combine([SAME, BETTER, SAME]) == BETTER
    assert combine([BETTER, WORSE]) == WORSE
    assert combine([SAME, SAME]) == SAME
    with pytest.raises(ValueError):
        compare("goodput_ratio", [1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        bootstrap_mean([])
    interval = bootstrap_mean([1.0, 2.0, 3.0])
    assert interval.low <= interval.estimate == 2.0 <= interval.high
    # at least the t interval: 2 ± 4.303 × 1 / sqrt(3)
    assert interval.low == pytest.approx(2 - 4.303 / 3 ** 0.5)
    assert not bootstrap_mean([5.0]).excludes_zero()


def test_two_seeds_that_merely_agree_in_sign_are_no_change():
    # both seeds 10 % and 30 % better: a percentile bootstrap would exclude zero; t does not
    assert compare("goodput_ratio", [1.0, 1.0], [1.1, 1.3]).verdict == SAME
    assert compare("goodput_ratio", [1.0, 1.0], [1.30, 1.31]).verdict == BETTER


def test_shares_are_compared_in_points():
    # 0 -> 3 % wasted every seed: a "100 %" relative change, but under 5 points: no change
    assert compare("wasted_share", [0.0, 0.0, 0.0], [0.03, 0.03, 0.031]).verdict == SAME
    assert compare("wasted_share", [0.0, 0.0, 0.0], [0.30, 0.31, 0.30]).verdict == WORSE


def test_a_consistent_cut_counts_though_the_seeds_baselines_differ():
    # TTFT p90 per seed, prefix cache off vs on: -78 %, -89 %, -85 %
    v = compare("ttft_p90_s", [0.166, 0.382, 0.267], [0.037, 0.043, 0.039])
    assert v.verdict == BETTER and v.relative_change.estimate == pytest.approx(-0.84, abs=0.01)
