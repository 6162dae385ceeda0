"""The retry budget: how many retries an overloaded service lets its clients make.

Envoy's retry budget and gRPC's retry throttling rest on one observation: when a service sheds
because it is overloaded, every retry it advises comes back into the same overload. So retries
are allowed only as a small share of first attempts. Over a sliding window of ``window_s``
seconds, per tenant and globally, :class:`RetryBudget` counts

* first attempts and retries as they arrive (the guard detects retries from the OpenAI SDK's
  ``x-stainless-retry-count``, a repeated ``Idempotency-Key`` and other clients' headers), and
* the retries it has *advised*: every shed that told its client "retry after X".

The allowance is ``max(min_retries, budget_ratio × first attempts)``. A retry that arrives with
the retries seen over the allowance (for its tenant or globally) is over budget: the policy sheds
it first. A shed may advise a retry only while the retries used — the larger of those seen and
those advised — are below the allowance for both its tenant and the whole guard; otherwise it
says ``x-should-retry: false`` and gives no wait, so SDKs stop. Advised retries count against the
allowance at once, so the advice never promises more retries than the budget holds. When load
falls, sheds stop, the window slides past the old retries, and advice returns to "retry after X".

Pure: time is passed in (``now_s``); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["RetryBudgetConfig", "RetryBudget", "RetryBudgetView", "GLOBAL",
           "NO_RETRY_OVER_BUDGET"]

GLOBAL = "*"  # the key of the guard-wide window (tenant names are never "*"-only by config)
_NUM_BUCKETS = 10


@dataclass(frozen=True)
class RetryBudgetConfig:
    """``budget_ratio``: retries allowed per first attempt (default 10 %); ``window_s``: the
    sliding window; ``min_retries``: retries allowed per window however few first attempts."""

    budget_ratio: float = 0.10
    window_s: float = 10.0
    min_retries: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget_ratio <= 1.0:
            raise ValueError(f"retry budget_ratio must be in [0, 1], got {self.budget_ratio!r}")
        if not self.window_s > 0:
            raise ValueError(f"retry window_s must be > 0, got {self.window_s!r}")
        if isinstance(self.min_retries, bool) or not isinstance(self.min_retries, int) \
                or self.min_retries < 0:
            raise ValueError(f"retry min_retries must be an int >= 0, got {self.min_retries!r}")

    def allowance(self, num_first_attempts: int) -> float:
        return max(float(self.min_retries), self.budget_ratio * num_first_attempts)


@dataclass(frozen=True)
class RetryBudgetView:
    """Which retries are over budget at one moment: what a load snapshot carries."""

    over_tenants: frozenset[str] = frozenset()
    over_global: bool = False

    def is_over(self, tenant: str) -> bool:
        return self.over_global or tenant in self.over_tenants


NO_RETRY_OVER_BUDGET = RetryBudgetView()


class _Window:
    """Counts over the last ``num_buckets`` buckets of ``bucket_s`` each."""

    __slots__ = ("bucket_s", "buckets", "num_first", "num_retries", "num_advised")

    def __init__(self, bucket_s: float) -> None:
        self.bucket_s = bucket_s
        self.buckets: deque[list[int]] = deque()  # [bucket index, first, retries, advised]
        self.num_first = self.num_retries = self.num_advised = 0

    def roll(self, now_s: float) -> None:
        oldest = int(now_s // self.bucket_s) - _NUM_BUCKETS + 1
        buckets = self.buckets
        while buckets and buckets[0][0] < oldest:
            _, first, retries, advised = buckets.popleft()
            self.num_first -= first
            self.num_retries -= retries
            self.num_advised -= advised

    def add(self, now_s: float, first: int, retries: int, advised: int) -> None:
        index = int(now_s // self.bucket_s)
        buckets = self.buckets
        if not buckets or buckets[-1][0] < index:
            buckets.append([index, 0, 0, 0])
        last = buckets[-1]  # a clock that steps back lands in the newest bucket
        last[1] += first
        last[2] += retries
        last[3] += advised
        self.num_first += first
        self.num_retries += retries
        self.num_advised += advised

    def is_over(self, config: RetryBudgetConfig) -> bool:
        """Retries seen exceed the allowance."""
        return self.num_retries > config.allowance(self.num_first)

    def has_room(self, config: RetryBudgetConfig) -> bool:
        """One more retry fits: the retries used (seen or advised) are below the allowance."""
        return max(self.num_retries, self.num_advised) + 1 <= config.allowance(self.num_first)


class RetryBudget:
    """Per-tenant and global retry windows (see the module docstring). Not thread-safe: the
    guard calls it from its event loop."""

    def __init__(self, config: RetryBudgetConfig | None = None) -> None:
        self.config = config if config is not None else RetryBudgetConfig()
        self._bucket_s = self.config.window_s / _NUM_BUCKETS
        self._windows: dict[str, _Window] = {}
        self._view: RetryBudgetView | None = NO_RETRY_OVER_BUDGET
        self._view_bucket = -1

    def record(self, tenant: str, is_retry: bool, now_s: float) -> None:
        """A priced request arrived: a first attempt or a retry. (Once per request: the
        common case — the newest bucket is current — touches only the two windows' counts.)"""
        index = int(now_s // self._bucket_s)
        windows = self._windows
        own = windows.get(tenant) or self._window(tenant, now_s)
        glob = windows.get(GLOBAL) or self._window(GLOBAL, now_s)
        for window in (own, glob):
            buckets = window.buckets
            if not buckets or buckets[-1][0] != index:  # a new bucket (or a clock step back)
                window.roll(now_s)
                window.add(now_s, 0, 0, 0)
            if is_retry:
                buckets[-1][2] += 1
                window.num_retries += 1
            else:
                buckets[-1][1] += 1
                window.num_first += 1
        view = self._view
        if view is None or index != self._view_bucket:
            self._view = None
            return
        ratio, floor = self.config.budget_ratio, self.config.min_retries  # is_over, inlined
        own_over = own.num_retries > floor and own.num_retries > ratio * own.num_first
        glob_over = glob.num_retries > floor and glob.num_retries > ratio * glob.num_first
        if own_over != (tenant in view.over_tenants) or glob_over != view.over_global:
            self._view = None  # a verdict changed (same bucket: no window rolled otherwise)

    def is_over(self, tenant: str, now_s: float) -> bool:
        """Retries seen exceed the allowance for ``tenant`` or globally."""
        return self.view(now_s).is_over(tenant)

    def advise_retry(self, tenant: str, now_s: float) -> bool:
        """A request of ``tenant`` is being shed: may its client retry? A yes uses one retry
        of the allowance (tenant and global) at once."""
        windows = [self._window(key, now_s) for key in (tenant, GLOBAL)]
        if not all(w.has_room(self.config) for w in windows):
            return False
        for window in windows:
            window.add(now_s, 0, 0, 1)
        return True

    def view(self, now_s: float) -> RetryBudgetView:
        """Which tenants' retries are over budget now (cached until a record changes a verdict, or a new bucket)."""
        bucket = int(now_s // self._bucket_s)
        if self._view is not None and bucket == self._view_bucket:
            return self._view
        over = []
        for key, window in self._windows.items():
            window.roll(now_s)
            if key != GLOBAL and window.is_over(self.config):
                over.append(key)
        glob = self._windows.get(GLOBAL)
        self._view = RetryBudgetView(frozenset(over),
                                     glob is not None and glob.is_over(self.config))
        self._view_bucket = bucket
        return self._view

    def counts(self, tenant: str, now_s: float) -> tuple[int, int, int]:
        """``(first attempts, retries, advised retries)`` in ``tenant``'s window (``GLOBAL``:
        the guard-wide one, which the guard exports)."""
        window = self._window(tenant, now_s)
        return window.num_first, window.num_retries, window.num_advised

    def _window(self, key: str, now_s: float) -> _Window:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(self._bucket_s)
        window.roll(now_s)
        return window
