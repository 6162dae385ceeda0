"""The ``[budget]`` table: default limits for every tenant and the store's settings.

Per-tenant limits (``tokens_per_minute``, ``requests_per_minute``, ``max_concurrent`` on a
``[[tenants]]`` entry) override these defaults axis by axis; the anonymous tenant gets the
defaults. Where the budgets are kept is the top-level ``redis_url`` (none: in this process).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from guard.budget.store import BudgetLimits
from serving.checks import require_count, require_seconds

__all__ = ["BudgetConfig", "LIMIT_KEYS"]

LIMIT_KEYS = ("tokens_per_minute", "requests_per_minute", "max_concurrent")
_FLOAT_KEYS = ("lease_s", "redis_timeout_s", "retry_max_s", "heartbeat_s", "settle_delay_s")


@dataclass(frozen=True)
class BudgetConfig:
    """Defaults (``None``: unlimited) and store settings, validated on construction.

    ``lease_s``: how long a grant's slot and reservation outlive a holder that stops renewing
    them (a crashed guard). ``redis_timeout_s``: the longest a request waits on Redis.
    ``breaker_failures``: consecutive Redis failures that switch the guard to its local share.
    ``retry_max_s``: the longest pause between reconnect attempts while on the local share.
    ``heartbeat_s``: how often a guard announces itself (live guards divide the local share).
    ``settle_delay_s``: settles are batched for this long (0: each settle is its own call).
    ``expected_guards``: how many guards share these budgets, assumed until this guard has
    reached Redis once (its start-up share is each limit ÷ this; afterwards the live guards
    seen in Redis's heartbeats divide it). Set it to the number of guards you run.
    ``reserve_ahead``: far from a tenant's limit, a Redis batch also reserves grants ahead that
    later requests take without a round trip (:mod:`guard.budget.grant_pool`).
    """

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    lease_s: float = 30.0
    redis_timeout_s: float = 0.05
    breaker_failures: int = 3
    retry_max_s: float = 1.0
    heartbeat_s: float = 1.0
    settle_delay_s: float = 0.02
    expected_guards: int = 3
    reserve_ahead: bool = True

    def __post_init__(self) -> None:
        try:
            self.default_limits  # noqa: B018 - validates the three limits
        except ValueError as exc:
            raise ValueError(str(exc).replace("budget ", "budget.", 1)) from None
        for name in _FLOAT_KEYS:
            require_seconds(f"budget.{name}", getattr(self, name),
                            allow_zero=name == "settle_delay_s")
        if not self.redis_timeout_s <= 5.0:
            raise ValueError("budget.redis_timeout_s: must be <= 5 s (requests wait on it)")
        if not self.heartbeat_s * 3 <= self.lease_s or self.settle_delay_s * 10 > self.lease_s:
            raise ValueError("budget.lease_s: must be >= 3 × heartbeat_s and >= 10 × settle_delay_s")
        require_count("budget.breaker_failures", self.breaker_failures)
        require_count("budget.expected_guards", self.expected_guards)
        if not isinstance(self.reserve_ahead, bool):
            raise ValueError(f"budget.reserve_ahead: must be true or false, got "
                             f"{self.reserve_ahead!r}")

    @functools.cached_property
    def default_limits(self) -> BudgetLimits:  # built once (read on every budgeted request)
        return BudgetLimits(self.tokens_per_minute, self.requests_per_minute, self.max_concurrent)

    def limits(self, own: BudgetLimits) -> BudgetLimits:
        """A tenant's ``own`` limits with each unset axis taken from the defaults."""
        values = {k: getattr(own, k) if getattr(own, k) is not None else getattr(self, k)
                  for k in LIMIT_KEYS}
        return BudgetLimits(**values)

    @classmethod
    def from_dict(cls, table: Any) -> BudgetConfig:
        if not isinstance(table, Mapping):
            raise ValueError("budget: must be a table")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"budget.{unknown[0]}: unknown key")
        values = dict(table)
        for name in _FLOAT_KEYS:
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        return cls(**values)
