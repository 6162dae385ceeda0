"""Each tenant's share of retries among its most recent requests (the ``retry_shed`` input)."""

from __future__ import annotations

from collections import deque

__all__ = ["RetryRatio"]


class RetryRatio:
    """Per-tenant share of retries over each tenant's most recent ``window`` requests.

    ``ratios`` is the live per-tenant mapping a load snapshot copies.
    """

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise ValueError(f"RetryRatio: window must be >= 1, got {window!r}")
        self._window = window
        self._recent: dict[str, deque[bool]] = {}
        self._num_retries: dict[str, int] = {}
        self.ratios: dict[str, float] = {}

    def record(self, tenant: str, is_retry: bool) -> None:
        recent = self._recent.get(tenant)
        if recent is None:
            recent = self._recent[tenant] = deque(maxlen=self._window)
        num = self._num_retries.get(tenant, 0)
        if len(recent) == self._window:
            num -= recent[0]
        recent.append(is_retry)
        self._num_retries[tenant] = num = num + is_retry
        self.ratios[tenant] = num / len(recent)
