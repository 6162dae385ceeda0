"""Envoy's circuit breakers and retry budget in front of the replicas: a bake-off baseline.

What an operator who protects an upstream with Envoy alone configures (Envoy's cluster
``circuit_breakers`` and a route ``retry_policy``, as its docs describe them):

* ``max_requests`` and ``max_connections`` (the replicas speak HTTP/1.1, one request per
  connection, so the connection limit is the one that binds) at M, the concurrency the fleet
  holds at its capacity C; a request past them waits in Envoy's pending queue;
* ``max_pending_requests`` at P = C × half the TTFT limit: a queue the fleet drains within
  half the first-token budget (the other half is the replica's own prefill); past it Envoy
  answers 503 at once ("reset reason: overflow");
* a ``retry_budget`` (Envoy's documented defaults, 20 % of the active and pending requests,
  at least 3) and route retries on ``5xx,reset,connect-failure`` to another replica
  (``previous_hosts``), once (Envoy's default count). Envoy never retries its own overflow.

M has no default: ``kvguard bench overload --fleet ... --envoy-max-requests M``. Envoy's own
(1,024 for each threshold) never trips in front of a few replicas; a replica's sequence slots
or KV-limited sequences (``kvguard plan``) are far above what a prefill-bound workload serves
in time; and the rules of thumb we tried (the p90 in flight at C; Little's law at the
latency of 0.5 C) missed the best M by half either way. An operator finds it with a short
sweep of M at the load it must hold (docs/benchmarks.md §15 shows ours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CircuitBreaker"]

# Envoy's defaults for a retry budget (its proto docs): budget_percent, min_retry_concurrency
RETRY_BUDGET_PERCENT = 20.0
MIN_RETRY_CONCURRENCY = 3


@dataclass(frozen=True)
class CircuitBreaker:
    """One cluster's thresholds (``max_requests`` also caps connections) and retry budget."""

    max_requests: int
    max_pending_requests: int
    retry_budget_percent: float = RETRY_BUDGET_PERCENT
    min_retry_concurrency: int = MIN_RETRY_CONCURRENCY
    num_retries: int = 1

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_pending_requests", "min_retry_concurrency",
                     "num_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not 0 < self.retry_budget_percent <= 100:
            raise ValueError(f"retry_budget_percent: must be in (0, 100], got "
                             f"{self.retry_budget_percent!r}")

    @classmethod
    def at_capacity(cls, max_requests: int, capacity_rps: float,
                    ttft_limit_s: float) -> CircuitBreaker:
        """M as given; P = C × half the TTFT limit (at least 1)."""
        if not capacity_rps > 0 or not ttft_limit_s > 0:
            raise ValueError("capacity_rps and ttft_limit_s must be > 0")
        return cls(max_requests, max(1, math.ceil(capacity_rps * ttft_limit_s / 2)))

    def circuit_breakers(self) -> dict:
        """The cluster's ``circuit_breakers`` (default priority)."""
        return {"thresholds": [{
            "max_connections": self.max_requests,
            "max_pending_requests": self.max_pending_requests,
            "max_requests": self.max_requests,
            "retry_budget": {"budget_percent": {"value": self.retry_budget_percent},
                             "min_retry_concurrency": self.min_retry_concurrency},
            "track_remaining": True,
        }]}

    def retry_policy(self) -> dict:
        """The route's ``retry_policy``: a failed or reset attempt goes to another replica."""
        return {"retry_on": "5xx,reset,connect-failure", "num_retries": self.num_retries,
                "retry_host_predicate": [{
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host."
                                 "previous_hosts.v3.PreviousHostsPredicate"}}],
                "host_selection_retry_max_attempts": 3}

    def to_dict(self) -> dict:
        return {"max_requests": self.max_requests,
                "max_pending_requests": self.max_pending_requests,
                "retry_budget_percent": self.retry_budget_percent,
                "min_retry_concurrency": self.min_retry_concurrency,
                "num_retries": self.num_retries}
