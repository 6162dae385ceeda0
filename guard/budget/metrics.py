"""Budget metrics on an injected Prometheus registry.

``kvguard_budget_backend{backend="redis"|"local"}`` (1 for the one in use; ``local`` also for
a guard with only the in-memory store), ``kvguard_budget_breaker_open``,
``kvguard_budget_live_guards``, ``kvguard_budget_redis_rtt_seconds`` (histogram),
``kvguard_budget_lease_expiries_reclaimed_total``, ``kvguard_budget_remaining_tokens{tenant}`` and
``kvguard_budget_remaining_requests{tenant}`` (as last seen by the backend in use: Redis's reply,
or the local share; the first ``max_tenant_labels`` tenants seen; later ones are not exported, so
cardinality stays bounded).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

__all__ = ["BudgetMetrics", "RTT_BUCKETS_S"]

RTT_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)


class BudgetMetrics:
    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int = 20) -> None:
        self.backend = Gauge("kvguard_budget_backend", "1 for the budget backend in use",
                             ["backend"], registry=registry)
        self.breaker_open = Gauge("kvguard_budget_breaker_open",
                                  "1 while the Redis breaker is open (local share)",
                                  registry=registry)
        self.live_guards = Gauge("kvguard_budget_live_guards",
                                 "Guard instances last seen live in Redis", registry=registry)
        self.rtt = Histogram("kvguard_budget_redis_rtt_seconds", "Redis budget script round trip",
                             buckets=RTT_BUCKETS_S, registry=registry)
        self.reclaimed = Counter("kvguard_budget_lease_expiries_reclaimed",
                                 "Expired leases whose slots and tokens were reclaimed",
                                 registry=registry)
        self._max_tenants = max_tenant_labels
        self._remaining: Callable[[], dict[str, float]] = dict
        self._remaining_requests: Callable[[], dict[str, float]] = dict
        registry.register(_RemainingCollector(self))
        self.set_backend("local")

    def set_backend(self, backend: str) -> None:
        for name in ("redis", "local"):
            self.backend.labels(name).set(1 if name == backend else 0)
        self.breaker_open.set(0)

    def set_breaker(self, is_open: bool) -> None:
        self.set_backend("local" if is_open else "redis")
        self.breaker_open.set(1 if is_open else 0)

    def watch_remaining(self, remaining: Callable[[], dict[str, float]],
                        requests: Callable[[], dict[str, float]] | None = None) -> None:
        """Read the remaining tokens (and requests) per tenant at scrape time."""
        self._remaining = remaining
        self._remaining_requests = requests or dict

    def remaining_family(self) -> GaugeMetricFamily:
        return self._family("kvguard_budget_remaining_tokens",
                            "Tokens the tenant could still reserve (last seen)", self._remaining)

    def remaining_requests_family(self) -> GaugeMetricFamily:
        return self._family("kvguard_budget_remaining_requests",
                            "Requests the tenant could still make this minute (last seen)",
                            self._remaining_requests)

    def _family(self, name: str, doc: str,
                values: Callable[[], dict[str, float]]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, value in list(values().items())[: self._max_tenants]:
            family.add_metric([tenant], value)
        return family


class _RemainingCollector:
    def __init__(self, metrics: BudgetMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        yield self._metrics.remaining_family()
        yield self._metrics.remaining_requests_family()

    def describe(self):
        return []
