"""The measured drain rate: completions per second over a sliding window (injected clock)."""

from __future__ import annotations

from collections import deque

__all__ = ["DrainRate"]


class DrainRate:
    """Counts completions in the last ``window_s`` seconds.

    ``rate_rps(now_s)`` divides by the window, or by the time since the first completion while
    the estimator is younger than the window (so it is not biased low right after start), but never by less than one second.
    """

    def __init__(self, window_s: float = 10.0, max_events: int = 100_000):
        if window_s <= 0 or max_events < 1:
            raise ValueError("DrainRate: window_s must be > 0 and max_events >= 1")
        self._window_s = window_s
        self._times_s: deque[float] = deque(maxlen=max_events)
        self._started_s: float | None = None

    def record(self, now_s: float, count: int = 1) -> None:
        """``count`` requests finished at ``now_s``."""
        if self._started_s is None:
            self._started_s = now_s
        if count == 1:
            self._times_s.append(now_s)
        else:
            self._times_s.extend([now_s] * count)

    def rate_rps(self, now_s: float) -> float:
        cutoff_s = now_s - self._window_s
        while self._times_s and self._times_s[0] < cutoff_s:
            self._times_s.popleft()
        if not self._times_s or self._started_s is None:
            return 0.0
        span_s = min(self._window_s, max(now_s - self._started_s, 1.0))
        return len(self._times_s) / span_s
