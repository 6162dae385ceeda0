"""Answering, counting and tracing every request that ends without a ticket.

:class:`Rejecter` turns a policy's :class:`~policies.decision.Shed` into a 429/503 with a
Retry-After from the measured drain rate (and ``x-should-retry: false`` when the wait would
outlast the client's own deadline), a never-servable request into a 400/401/413 that costs
nothing, and a client that left before admission into a ``canceled`` count. The rejection
bodies and headers themselves are :mod:`guard.rejection`'s.
"""

from __future__ import annotations

from collections.abc import Callable

from guard.admission_queue import AdmissionQueue
from guard.config import GuardConfig, TenantConfig
from guard.drain_rate import DrainRate
from guard.metrics import GuardMetrics
from guard.pricing import PricingError
from guard.rejection import Rejection, RetryAdvisor
from guard.ticket import TicketBook
from guard.trace import TraceWriter, rejection_record
from policies.cost import RequestCost
from policies.decision import Shed

__all__ = ["Rejecter", "client_timeout_s"]

_SHED_MESSAGES = {
    429: "Rate limit reached for this tenant; retry after the indicated time.",
    503: "The service is overloaded; retry after the indicated time.",
}


class Rejecter:
    """Sheds and early rejections for one guard. ``service_s`` returns the measured time an
    admitted request holds its ticket (the Retry-After fallback)."""

    def __init__(self, config: GuardConfig, clock: Callable[[], float], metrics: GuardMetrics,
                 queue: AdmissionQueue, tickets: TicketBook, drain_rate: DrainRate,
                 retry_advisor: RetryAdvisor, service_s: Callable[[], float],
                 trace: TraceWriter | None) -> None:
        self._config = config
        self._clock = clock
        self._metrics = metrics
        self._queue = queue
        self._tickets = tickets
        self._drain_rate = drain_rate
        self._retry_advisor = retry_advisor
        self._service_s = service_s
        self.trace = trace

    def shed(self, cost: RequestCost, shed: Shed, headers: dict[str, str],
             enqueue_s: float | None) -> Rejection:
        """Count and trace a shed; the rejection to send."""
        now_s = self._clock()
        if shed.status < 500 and shed.status != 429:  # the policy says: never servable
            error = PricingError(shed.status, shed.reason, "This request can never be served "
                                 "as sent: it does not fit any replica.")
            return self.reject_early(cost.request_id, cost.tenant, cost.arrival_s,
                                     error, cost.request_class.name, counted=True)
        num_ahead = len(self._queue)
        wait_s = self._retry_advisor.retry_after_s(
            num_ahead=num_ahead, drain_rate_rps=self._drain_rate.rate_rps(now_s),
            policy_retry_after_s=shed.retry_after_s,
            expected_free_s=self._expected_free_s(now_s, num_ahead),
            fallback_s=self._service_s())
        remaining_s = client_timeout_s(headers, self._config.deadline_header)
        if remaining_s is not None:
            remaining_s -= now_s - cost.arrival_s
        should_retry = shed.should_retry and RetryAdvisor.should_retry(wait_s, remaining_s)
        message = _SHED_MESSAGES.get(shed.status, _SHED_MESSAGES[503])
        rejection = Rejection(shed.status, shed.reason, message, wait_s, should_retry)
        self._metrics.rejected(cost.request_class.name, cost.tenant, shed.reason).inc()
        if self.trace is not None:
            self.trace.write(rejection_record(cost.request_id, cost.tenant, cost.request_class.name,
                                               cost.arrival_s, now_s, enqueue_s, shed.status, shed.reason))
        return rejection

    def deny(self, cost: RequestCost, reason: str, retry_after_s: float | None) -> Rejection:
        """The tenant's budget said no (429): a wait only when the store gave one."""
        self._metrics.rejected(cost.request_class.name, cost.tenant, reason).inc()
        if self.trace is not None:
            self.trace.write(rejection_record(cost.request_id, cost.tenant, cost.request_class.name,
                                               cost.arrival_s, self._clock(), None, 429, reason))
        return Rejection(429, reason, _SHED_MESSAGES[429] if retry_after_s is not None else
                         "This request exceeds the tenant's budget and can never fit it.",
                         retry_after_s, retry_after_s is not None)

    def _expected_free_s(self, now_s: float, num_ahead: int) -> float | None:
        """When the ``num_ahead + 1``-th in-flight request is expected to finish, from each
        ticket's dispatch time and the measured service time; None with nothing in flight."""
        held = self._tickets.held()
        if not held:
            return None
        service_s = self._service_s()
        finishes_s = sorted(t.dispatch_s + service_s for t in held)
        index = min(num_ahead, len(finishes_s) - 1)
        return max(0.0, finishes_s[index] - now_s)

    def reject_early(self, request_id: str, tenant: TenantConfig | str | None,
                     arrival_s: float, error: PricingError, class_name: str | None = None,
                     counted: bool = False) -> Rejection:
        """Never servable as sent (400/401/404/413): no budget, no blocks, never retry."""
        self.count_early(request_id, tenant, arrival_s, class_name, "rejected",
                         reason=error.reason, status=error.status, counted=counted)
        return Rejection(error.status, error.reason, error.message, None, False,
                         getattr(error, "param", None))

    def count_early(self, request_id: str, tenant: TenantConfig | str | None, arrival_s: float,
                    class_name: str | None, outcome: str, enqueue_s: float | None = None,
                    reason: str = "client_disconnected", status: int = 499,
                    counted: bool = False) -> None:
        """Count (and trace) a request that ended without a ticket."""
        if isinstance(tenant, TenantConfig):
            class_name = class_name or tenant.default_class
            tenant = tenant.name
        tenant_name = tenant or "unknown"
        class_name = class_name or self._config.default_class
        if enqueue_s is None and not counted:  # priced requests were counted as offered
            self._metrics.counters(class_name, tenant_name).offered.inc()
        if outcome == "rejected":
            self._metrics.rejected(class_name, tenant_name, reason).inc()
        else:
            self._metrics.counters(class_name, tenant_name).canceled.inc()
        if self.trace is not None:
            self.trace.write(rejection_record(request_id, tenant_name, class_name, arrival_s,
                                               self._clock(), enqueue_s, status, reason, outcome))


def client_timeout_s(headers: dict[str, str], deadline_header: str) -> float | None:
    """The client's own deadline in seconds from arrival, if it told us one."""
    for name, scale in (("x-stainless-read-timeout", 1.0), (deadline_header, 0.001)):
        value = headers.get(name)
        if value is not None:
            try:
                timeout_s = float(value) * scale
            except ValueError:
                continue
            if timeout_s > 0:
                return timeout_s
    return None
