"""Is the candidate better, worse, or not significantly different? Pure functions of the
per-seed numbers of one scenario.

Each seed runs the same seeded users against both fleets, so the samples are **paired**: the
test is on the per-seed changes ``(candidate − baseline) ÷ baseline`` (shares, such as the
wasted share, in absolute points instead), so a consistent 80 % cut counts even when the
seeds' baselines differ widely.
A metric changed when the bootstrap confidence interval of the mean relative difference
excludes zero **and** its point estimate is at least ``min_effect_ratio`` (a change too small
to matter is no change, whatever its interval: with few seeds and many metrics the interval
alone would call noise a change). The sign of the change and the metric's direction (higher
goodput is better, higher cost is worse) give better or worse.

A percentile bootstrap over a handful of seeds understates the spread (with two seeds its
interval is just the two values), so the interval is widened to at least the Student-t
interval of the same mean: few seeds then need a large, consistent change to count.

A scenario is worse when any metric is worse, better when one is better and none is worse, and
otherwise "no significant change"; the review overall likewise over its scenarios.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BETTER", "WORSE", "SAME", "METRICS", "ABSOLUTE_METRICS", "Interval", "MetricVerdict", "bootstrap_mean",
           "compare", "combine"]

BETTER, WORSE, SAME = "better", "worse", "no significant change"
# metric -> +1 when higher is better, -1 when lower is better
METRICS: Mapping[str, int] = {
    "goodput_ratio": +1,
    "ttft_p90_s": -1,
    "good_tokens_per_s": +1,
    "cost_per_good_request_usd": -1,
    "wasted_share": -1,
}
# shares compared in absolute points (a share of 0 has no relative change): 0.05 = 5 points
ABSOLUTE_METRICS = frozenset({"wasted_share"})


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


# two-sided 95 % Student-t quantiles by degrees of freedom (1 … 10); 2.0 beyond, near enough
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def _t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 2.0


def bootstrap_mean(values: Sequence[float], confidence: float = 0.95,
                   num_resamples: int = 2000, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of the mean of ``values`` (seeded: reproducible); at 95 %
    widened to at least the Student-t interval (see the module docstring)."""
    if not values:
        raise ValueError("bootstrap_mean: need at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(num_resamples))
    tail = (1 - confidence) / 2
    low = means[math.floor(tail * (num_resamples - 1))]
    high = means[math.ceil((1 - tail) * (num_resamples - 1))]
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf)  # one seed says nothing about spread
    if confidence == 0.95:
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = _t95(n - 1) * sd / math.sqrt(n)
        low, high = min(low, mean - half), max(high, mean + half)
    return Interval(mean, low, high)


@dataclass(frozen=True)
class MetricVerdict:
    metric: str
    verdict: str
    baseline: Interval | None
    candidate: Interval | None
    # mean of (candidate − baseline) ÷ |baseline| per seed; for ABSOLUTE_METRICS in points
    relative_change: Interval | None
    num_pairs: int

    def to_dict(self) -> dict:
        def iv(x: Interval | None):
            return None if x is None else [x.estimate, x.low, x.high]
        return {"verdict": self.verdict, "baseline": iv(self.baseline),
                "candidate": iv(self.candidate), "relative_change": iv(self.relative_change),
                "num_pairs": self.num_pairs}


def compare(metric: str, baseline: Sequence[float | None], candidate: Sequence[float | None],
            min_effect_ratio: float = 0.05, confidence: float = 0.95) -> MetricVerdict:
    """One metric over paired seeds (a None on either side drops that seed: e.g. no good
    request, so no cost per good request)."""
    if len(baseline) != len(candidate):
        raise ValueError(f"{metric}: {len(baseline)} baseline vs {len(candidate)} candidate seeds")
    direction = METRICS[metric]
    pairs = [(b, c) for b, c in zip(baseline, candidate, strict=True)
             if b is not None and c is not None]
    if not pairs:
        return MetricVerdict(metric, SAME, None, None, None, 0)
    base = bootstrap_mean([b for b, _ in pairs], confidence)
    cand = bootstrap_mean([c for _, c in pairs], confidence)
    change = bootstrap_mean([_change(metric, b, c, base.estimate) for b, c in pairs], confidence)
    verdict = SAME
    if change.excludes_zero() and abs(change.estimate) >= min_effect_ratio:
        verdict = BETTER if change.estimate * direction > 0 else WORSE
    return MetricVerdict(metric, verdict, base, cand, change, len(pairs))


def _change(metric: str, baseline: float, candidate: float, baseline_mean: float) -> float:
    """One seed's change: in points for a share, else relative to that seed's baseline (to
    the baseline mean where the seed's is 0)."""
    if metric in ABSOLUTE_METRICS:
        return candidate - baseline
    scale = abs(baseline) or abs(baseline_mean) or max(abs(candidate), 1e-12)
    return (candidate - baseline) / scale


def combine(verdicts: Sequence[str]) -> str:
    """Worse if any is worse; better if any is better (and none worse); else no change."""
    if WORSE in verdicts:
        return WORSE
    return BETTER if BETTER in verdicts else SAME
