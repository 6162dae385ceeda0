"""How good the TTFT forecast is: predicted ÷ actual on the admitted requests that got a token.

The SLO policy admits on a forecast, so its error is the first thing to look at when admitted
requests miss (ratio < 1: the forecast was optimistic) or the guard sheds below capacity
(ratio > 1: pessimistic). :class:`ForecastError` keeps the ratios of the last ``window``
admitted requests with a first token and reports the median and p90 of predicted ÷ actual and
the median absolute relative error ``|predicted − actual| / actual``; the guard exports them as
gauges next to goodput (``kvguard_ttft_forecast_ratio{stat="p50"|"p90"}``,
``kvguard_ttft_forecast_abs_error_ratio``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["ForecastError", "ForecastErrorSummary"]


@dataclass(frozen=True)
class ForecastErrorSummary:
    num_samples: int
    median_ratio: float  # predicted ÷ actual
    p90_ratio: float
    median_abs_error_ratio: float  # |predicted − actual| ÷ actual


class ForecastError:
    """Sliding window of predicted ÷ actual TTFT ratios."""

    def __init__(self, window: int = 1000) -> None:
        if window < 1:
            raise ValueError(f"ForecastError: window must be >= 1, got {window!r}")
        self._ratios: deque[float] = deque(maxlen=window)
        self._summary: ForecastErrorSummary | None = None

    def observe(self, predicted_s: float | None, actual_s: float | None) -> None:
        """One admitted request's forecast and its measured TTFT (ignored if either is
        missing or not positive)."""
        if predicted_s is None or actual_s is None or predicted_s <= 0 or actual_s <= 0:
            return
        self._ratios.append(predicted_s / actual_s)
        self._summary = None

    def summary(self) -> ForecastErrorSummary | None:
        """None until a sample arrives; computed once per change (at scrape time)."""
        if self._summary is None and self._ratios:
            ratios = sorted(self._ratios)
            errors = sorted(abs(r - 1.0) for r in ratios)
            self._summary = ForecastErrorSummary(len(ratios), _quantile(ratios, 0.5),
                                                 _quantile(ratios, 0.9), _quantile(errors, 0.5))
        return self._summary


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
