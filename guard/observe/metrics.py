"""The guard's Prometheus metrics, on an injected registry (no globals).

The request path only bumps plain Python numbers (a labelled child is looked up once per
(class, tenant) and cached); one :class:`prometheus_client` collector turns them into metric
families at scrape time, so a request never takes a metrics lock.

Outcome counters are labelled by request ``class`` and ``tenant``; tenants are bounded: the
first ``max_tenants`` distinct names keep their label, later ones share ``other``. Goodput is
judged from the stream the guard itself relayed (see :meth:`guard.admission.ticket.Ticket.met_slo`).
Gauges (queue length, held tickets, per-replica free and reserved KV blocks) are read at scrape
time from the ``gauges`` callable the owner installs.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from guard.admission.ticket import Ticket
from guard.observe.cost_meter import CostMeter
from guard.observe.forecast_error import ForecastError
from guard.observe.loop_lag import LoopLag

__all__ = ["GuardMetrics", "GaugeValues", "CONTENT_TYPE_LATEST", "OTHER_TENANT"]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                     10.0, 20.0, 60.0)
GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                 1.0, 2.5)
ERROR_BUCKETS = (-1.0, -0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0,
                 5.0)
OTHER_TENANT = "other"

# counter name (without _total) -> help; all labelled by class and tenant
_COUNTERS = {
    "offered": "Requests that reached the guard",
    "admitted": "Requests admitted to a replica",
    "queued": "Requests that waited in the admission queue",
    "canceled": "Requests whose client went away",
    "failed": "Admitted requests that errored",
    "completed": "Admitted requests that completed",
    "rejected_upstream": "Admitted requests the upstream refused with a 4xx",
}
# histogram attribute -> (metric name, help, buckets); all labelled by class
_HISTOGRAMS = {
    "ttft": ("kvguard_time_to_first_token_seconds", "Arrival to first content byte", LATENCY_BUCKETS_S),
    "itl": ("kvguard_inter_token_gap_seconds", "Gap between content chunks", GAP_BUCKETS_S),
    "queue_wait": ("kvguard_queue_wait_seconds", "Time spent in the admission queue", LATENCY_BUCKETS_S),
    "e2e": ("kvguard_request_duration_seconds", "Arrival to release", LATENCY_BUCKETS_S),
    "ttft_error": ("kvguard_ttft_prediction_error_ratio", "(actual - predicted) / predicted TTFT", ERROR_BUCKETS),
}


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class _Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return out


class _Counters:
    """One (class, tenant)'s outcome counters."""

    __slots__ = ("offered", "admitted", "queued", "canceled", "failed", "completed",
                 "rejected_upstream", "goodput")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, _Count())


class _Histograms:
    """One class's latency histograms."""

    __slots__ = tuple(_HISTOGRAMS)

    def __init__(self) -> None:
        for name, (_, _, bounds) in _HISTOGRAMS.items():
            setattr(self, name, _Histogram(bounds))


class GaugeValues:
    """What the gauges read at scrape time (the owner fills it from its live state)."""

    def __init__(self, queue_length: int = 0, held_tickets: int = 0,
                 free_blocks: dict[str, int] | None = None,
                 reserved_blocks: dict[str, int] | None = None,
                 concurrency_limits: dict[str, int] | None = None) -> None:
        self.queue_length = queue_length
        self.held_tickets = held_tickets
        self.free_blocks = free_blocks or {}
        self.reserved_blocks = reserved_blocks or {}
        self.concurrency_limits = concurrency_limits or {}


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry, max_tenants: int = 64) -> None:
        if max_tenants < 1:
            raise ValueError("max_tenants must be >= 1")
        self.registry = registry
        self.max_tenants = max_tenants
        self.gauges: Callable[[], GaugeValues] = GaugeValues
        self._tenants: set[str] = set()
        self._counters: dict[tuple[str, str], _Counters] = {}
        self._rejected: dict[tuple[str, str, str], _Count] = {}
        self._histograms: dict[str, _Histograms] = {}
        self.forecast_error = ForecastError()  # predicted ÷ actual TTFT of admitted requests
        self.loop_lag: LoopLag | None = None  # set by the owner that runs the sampler
        # (first attempts, retries, advised retries) in the retry budget's window, guard-wide
        self.retry_counts: Callable[[], tuple[int, int, int]] | None = None
        # the policy's active client-patience estimate per class (policies that learn one)
        self.client_patience: Callable[[], dict[str, float]] | None = None
        self.cost: CostMeter | None = None  # kvguard_cost_dollars_total, set by the owner
        registry.register(_Collector(self))

    # --- the request path ----------------------------------------------------------------
    def counters(self, class_name: str, tenant: str) -> _Counters:
        key = (class_name, tenant)
        found = self._counters.get(key)
        if found is None:
            label_key = (class_name, self.tenant_label(tenant))
            found = self._counters.get(label_key)
            if found is None:
                found = self._counters[label_key] = _Counters()
        return found

    def histograms(self, class_name: str) -> _Histograms:
        found = self._histograms.get(class_name)
        if found is None:
            found = self._histograms[class_name] = _Histograms()
        return found

    def rejected(self, class_name: str, tenant: str, reason: str) -> _Count:
        key = (class_name, self.tenant_label(tenant), reason)
        found = self._rejected.get(key)
        if found is None:
            found = self._rejected[key] = _Count()
        return found

    def tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    def on_released(self, ticket: Ticket) -> None:
        """Ticket release listener: outcome counters, goodput and latency histograms."""
        cost = ticket.cost
        if self.cost is not None:
            self.cost.add_bytes(ticket.num_request_bytes + ticket.num_response_bytes,
                                cost.request_class.name, self.tenant_label(cost.tenant))
        counters = self.counters(cost.request_class.name, cost.tenant)
        outcome = ticket.outcome
        if outcome == "completed":
            counters.completed.value += 1
            if ticket.slo_met:
                counters.goodput.value += 1
        elif outcome == "canceled":
            counters.canceled.value += 1
        elif outcome == "rejected_upstream":
            counters.rejected_upstream.value += 1
        else:
            counters.failed.value += 1
        hist = self.histograms(cost.request_class.name)
        first_token_s = ticket.first_token_s
        if first_token_s is not None:
            ttft_s = first_token_s - cost.arrival_s  # ticket.ttft_s, inlined
            hist.ttft.observe(ttft_s)
            predicted_s = ticket.predicted_ttft_s
            if predicted_s is not None and predicted_s > 0:
                hist.ttft_error.observe((ttft_s - predicted_s) / predicted_s)
                self.forecast_error.observe(predicted_s, ttft_s)
        if ticket.released_s is not None:
            hist.e2e.observe(ticket.released_s - cost.arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def send_response(self, send: Callable[[dict], Awaitable[None]]) -> None:
        """Answer an ASGI request with :meth:`render` in the Prometheus text format."""
        body = self.render()
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                   (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # --- scrape time ---------------------------------------------------------------------
    def families(self) -> Iterator:
        by_label = self._counters
        for name, help_text in _COUNTERS.items():
            family = CounterMetricFamily(f"kvguard_requests_{name}", help_text, labels=("class", "tenant"))
            for labels, counters in by_label.items():
                family.add_metric(labels, getattr(counters, name).value)
            yield family
        goodput = CounterMetricFamily("kvguard_goodput", "Completed requests that met their class SLO",
                                      labels=("class", "tenant"))
        for labels, counters in by_label.items():
            goodput.add_metric(labels, counters.goodput.value)
        yield goodput
        rejected = CounterMetricFamily("kvguard_requests_rejected", "Requests rejected, by reason",
                                       labels=("class", "tenant", "reason"))
        for labels, count in self._rejected.items():
            rejected.add_metric(labels, count.value)
        yield rejected
        yield from self._histogram_families()
        yield from self._gauge_families()
        yield from self._quality_families()
        if self.cost is not None:
            yield from self.cost.families()

    def _quality_families(self) -> Iterator:
        """The TTFT forecast's error and the event loop's lag (when sampled)."""
        summary = self.forecast_error.summary()
        ratio = GaugeMetricFamily("kvguard_ttft_forecast_ratio", "Predicted / actual TTFT of "
                                  "recent admitted requests (stat: p50, p90)", labels=("stat",))
        error = GaugeMetricFamily("kvguard_ttft_forecast_abs_error_ratio", "Median "
                                  "|predicted - actual| / actual TTFT of recent admitted requests")
        if summary is not None:
            ratio.add_metric(("p50",), summary.median_ratio)
            ratio.add_metric(("p90",), summary.p90_ratio)
            error.add_metric((), summary.median_abs_error_ratio)
        yield ratio
        yield error
        if self.retry_counts is not None:
            family = GaugeMetricFamily("kvguard_retry_budget_window", "First attempts, retries "
                                       "and retries advised (x-should-retry: true) in the retry "
                                       "budget's sliding window, guard-wide", labels=("kind",))
            counts = self.retry_counts()
            for kind, value in zip(("first_attempts", "retries", "advised"), counts, strict=True):
                family.add_metric((kind,), value)
            yield family
        if self.client_patience is not None:
            family = GaugeMetricFamily("kvguard_client_patience_seconds", "How long clients "
                                       "wait before abandoning an admitted request, learned from "
                                       "their cancellations: the shortest any client of the "
                                       "class holds (absent while none holds)",
                                       labels=("class",))
            for class_name, patience_s in sorted(self.client_patience().items()):
                family.add_metric((class_name,), patience_s)
            yield family
        if self.loop_lag is not None:
            yield GaugeMetricFamily("kvguard_event_loop_lag_max_seconds", "Largest lateness of "
                                    "the guard's 10 ms loop timer since start",
                                    value=self.loop_lag.max_lag_s)

    def _histogram_families(self) -> Iterator:
        for attr, (name, help_text, bounds) in _HISTOGRAMS.items():
            family = HistogramMetricFamily(name, help_text, labels=("class",))
            for class_name, hists in self._histograms.items():
                h = getattr(hists, attr)
                total = None if bounds[0] < 0 else h.sum  # no _sum when values can be negative
                family.add_metric((class_name,), h.cumulative(), total)
            yield family

    def _gauge_families(self) -> Iterator:
        values = self.gauges()
        yield GaugeMetricFamily("kvguard_queue_length", "Requests waiting in the admission queue",
                                value=values.queue_length)
        yield GaugeMetricFamily("kvguard_held_tickets", "Admitted requests not yet released",
                                value=values.held_tickets)
        for name, help_text, data in (
            ("kvguard_replica_free_blocks", "Free KV blocks reported by the replica", values.free_blocks),
            ("kvguard_replica_reserved_blocks", "KV blocks reserved by the guard, unreported",
             values.reserved_blocks),
            ("kvguard_replica_concurrency_limit", "Requests the guard lets run at once on the "
             "replica, learned from its first tokens, gaps and failures (enforced where the "
             "replica publishes no capacity)", values.concurrency_limits),
        ):
            family = GaugeMetricFamily(name, help_text, labels=("replica",))
            for replica_id, value in data.items():
                family.add_metric((replica_id,), value)
            yield family


class _Collector:
    def __init__(self, metrics: GuardMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator:
        return self._metrics.families()
