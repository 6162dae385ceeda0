"""Small order statistics used by goodput and the report (pure, no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "distribution"]

QUANTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, max and the usual percentiles of ``values``."""
    out: dict[str, float | int | None] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for q in QUANTILES:
        out[f"p{q:g}"] = percentile(values, q)
    out["max"] = max(values) if values else None
    return out
