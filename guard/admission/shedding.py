"""Shedding: every answer that is not an admission, and the retry advice it carries.

One place computes retry advice (:class:`Rejecter` with :class:`RetryAdvisor` and
:class:`DrainRate`), so the headers clients act on never contradict each other:

* 400/401/404/413 — never servable as sent (malformed body, unknown key, model not served,
  over the context or body limit): ``x-should-retry: false``, no wait, no budget, no blocks;
* 429 — the tenant's budget (from the budget store) or a policy's tenant limit;
* 503 — overload: a wait from the measured drain rate with the queue ahead counted, jittered,
  and never past the queue's horizon (the latest deadline of a queued request: every one of
  them has left by then, admitted or timed out, so the queue a retry meets is empty) —
  while the retry budget (:mod:`policies.retry_budget`, per tenant and model-wide, one per
  model: :mod:`guard.admission.retry_budgets`) has room;
  once retries would pass it, ``x-should-retry: false`` and no wait, so SDKs stop retrying
  into the overload (advice returns when load falls and the window slides past the retries);
* ``Retry-After`` / ``retry-after-ms`` are sent only together with ``x-should-retry: true``.

Every rejection carries an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}`` and ``x-kvguard-reason``. A client that left before admission is counted
``canceled``.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from guard.admission.queue import AdmissionQueue
from guard.admission.retry_budgets import RetryBudgets
from guard.admission.ticket import TicketBook
from guard.config import GuardConfig, TenantConfig
from guard.errors import PricingError
from guard.observe.metrics import GuardMetrics
from guard.observe.trace import TraceWriter, rejection_record
from guard.request.deadline import client_timeout_s
from policies.cost import RequestCost
from policies.decision import Shed
from policies.shed_reasons import (
    CONCURRENCY_LIMIT,
    NEVER_RETRY,
    NO_REPLICA,
    RETRY_SHED,
    SHUTTING_DOWN,
    TPM_LIMIT,
)

__all__ = ["DrainRate", "Rejecter", "Rejection", "RetryAdvisor", "error_type",
           "send_rejection"]

Send = Callable[[dict], Awaitable[None]]

# OpenAI's error.type per status (a bad or missing key is its invalid_request_error, code
# invalid_api_key); a tenant's rate limits are OpenAI's type "requests"/"tokens", code
# rate_limit_exceeded (kvguard's own reason stays in x-kvguard-reason)
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    """The OpenAI-style ``error.type`` for a status."""
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


@functools.lru_cache(maxsize=256)
def _error_body(status: int, reason: str, message: str, param: str | None) -> bytes:
    """The OpenAI-style error body. Memoised: a flood is answered with a handful of distinct
    (reason, message) pairs, and encoding the same JSON for every shed showed in the profile
    (``kvguard bench shed-cost --profile``)."""
    kind, code = (_RATE_LIMIT_TYPES.get(reason), "rate_limit_exceeded") if status == 429 \
        else (None, reason)
    error = {"message": message, "type": kind or error_type(status), "param": param,
             "code": code if kind else reason}
    return json.dumps({"error": error}).encode()


_RPM_LIMIT = "rpm_limit"  # a budget store's Denied reason (guard.budget)
_RATE_LIMIT_TYPES = {_RPM_LIMIT: "requests", TPM_LIMIT: "tokens", CONCURRENCY_LIMIT: "requests"}


@dataclass(frozen=True)
class Rejection:
    """One rejection, ready to send. ``retry_after_s`` ``None``: no Retry-After headers."""

    status: int
    reason: str
    message: str
    retry_after_s: float | None = None
    should_retry: bool = False
    param: str | None = None
    request_id: str | None = None  # the guard's id of the request (None: it had none yet)

    def __post_init__(self) -> None:
        if not 400 <= self.status < 600:
            raise ValueError(f"rejection status must be 4xx/5xx, got {self.status}")
        if not self.reason:
            raise ValueError("rejection needs a machine-readable reason")
        if self.retry_after_s is not None and self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.retry_after_s is not None and not self.should_retry:
            raise ValueError("a rejection advises a wait only together with should_retry")

    def body(self) -> bytes:
        return _error_body(self.status, self.reason, self.message, self.param)

    def response(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The response headers and body."""
        body = self.body()
        return self.headers(len(body)), body

    def headers(self, body_len: int) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(body_len).encode()),
            (b"x-should-retry", b"true" if self.should_retry else b"false"),
            (b"x-kvguard-reason", self.reason.encode()),
        ]
        if self.retry_after_s is not None:
            seconds = max(1, math.ceil(self.retry_after_s))
            millis = max(1, round(self.retry_after_s * 1000))
            headers.append((b"retry-after", str(seconds).encode()))
            headers.append((b"retry-after-ms", str(millis).encode()))
        return headers


async def send_rejection(send: Send, rejection: Rejection,
                         extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers, body = rejection.response()
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": rejection.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RetryAdvisor:
    """The wait before a retry can be served: the queue's drain estimate (never less than the
    policy's own estimate), jittered upwards so retries spread out but never come early.

    The RNG is injected so tests are exact.
    """

    def __init__(self, rng: random.Random, jitter_ratio: float = 0.2,
                 min_s: float = 0.05, max_s: float = 300.0) -> None:
        if not 0 <= jitter_ratio < 1:
            raise ValueError(f"jitter_ratio must be in [0, 1), got {jitter_ratio}")
        if not 0 < min_s <= max_s:
            raise ValueError("need 0 < min_s <= max_s")
        self._rng = rng
        self.jitter_ratio = jitter_ratio
        self.min_s = min_s
        self.max_s = max_s

    @staticmethod
    def queue_drain_s(*, num_ahead: int, drain_rate_rps: float, num_in_flight: int = 0,
                      service_s: float = 1.0, expected_free_s: float | None = None) -> float:
        """When the ``num_ahead + 1``-th slot frees: the largest of the measured drain rate's
        ``(num_ahead + 1) / drain_rate_rps``, the in-flight turnover's
        ``(num_ahead + 1) * service_s / num_in_flight`` (known from the first request on, before
        any completion is measured) and ``expected_free_s`` (a batch finishing together makes
        the average rate understate the wait); ``(num_ahead + 1) * service_s`` with none."""
        ahead = max(0, num_ahead) + 1
        estimates = []
        if drain_rate_rps > 0:
            estimates.append(ahead / drain_rate_rps)
        if num_in_flight > 0:
            estimates.append(ahead * service_s / num_in_flight)
        if expected_free_s is not None:
            estimates.append(expected_free_s)
        return max(estimates) if estimates else ahead * service_s

    def retry_after_s(self, *, num_ahead: int, drain_rate_rps: float,
                      policy_retry_after_s: float | None = None,
                      expected_free_s: float | None = None, num_in_flight: int = 0,
                      service_s: float = 1.0, queue_horizon_s: float | None = None) -> float:
        """The jittered wait: at least :meth:`queue_drain_s` (but no later than
        ``queue_horizon_s``, when every queued request ahead has left) and the policy's
        estimate."""
        base_s = self.queue_drain_s(num_ahead=num_ahead, drain_rate_rps=drain_rate_rps,
                                    num_in_flight=num_in_flight, service_s=service_s,
                                    expected_free_s=expected_free_s)
        if queue_horizon_s is not None:
            # the estimates above assume the queue leaves only through admissions; under
            # overload most of it times out instead, long before they say
            base_s = min(base_s, max(queue_horizon_s, expected_free_s or 0.0))
        if policy_retry_after_s is not None:
            base_s = max(base_s, policy_retry_after_s)
        jitter = 1.0 + self._rng.uniform(0.0, self.jitter_ratio)
        return min(self.max_s, max(self.min_s, base_s * jitter))

    @staticmethod
    def should_retry(wait_s: float, client_remaining_s: float | None, can_ever_fit: bool = True) -> bool:
        """``False`` when the request can never fit or the wait outlasts the client's deadline."""
        if not can_ever_fit:
            return False
        return client_remaining_s is None or wait_s <= client_remaining_s


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


RETRY_BUDGET = "retry_budget"  # the message key of a shed whose retry the budget refused
_NO_RETRY_MESSAGES = {
    RETRY_SHED: "The service is overloaded and sheds retries first; do not retry this request.",
    RETRY_BUDGET: "The service is overloaded and its retry budget is spent: a retry now would "
                  "only add to the overload. Try again later.",
    None: "The service cannot serve this request within its latency objective; do not retry.",
}
_SHED_MESSAGES = {
    429: "Rate limit reached for this tenant; retry after the indicated time.",
    503: "The service is overloaded; retry after the indicated time.",
}
# a 503's message names its real reason where "overloaded" would not be true
_UNAVAILABLE_MESSAGES = {
    NO_REPLICA: "No replica can serve this request now (none is routable); retry after the "
                "indicated time.",
    SHUTTING_DOWN: "This server is shutting down and admits no new requests; retry (another "
                   "instance can serve it).",
}
# a tenant budget's 429, by the limit that said no
_LIMIT_MESSAGES = {
    _RPM_LIMIT: "Rate limit reached for this tenant's requests per minute; retry after the "
               "indicated time.",
    TPM_LIMIT: "Rate limit reached for this tenant's tokens per minute; retry after the "
               "indicated time.",
    CONCURRENCY_LIMIT: "Rate limit reached for this tenant's concurrent requests; retry when "
                       "one of them has finished.",
}


class Rejecter:
    """Sheds and early rejections for one guard. ``service_s`` returns the measured time an
    admitted request holds its ticket (the Retry-After fallback)."""

    def __init__(self, config: GuardConfig, clock: Callable[[], float], metrics: GuardMetrics,
                 queue: AdmissionQueue, tickets: TicketBook, drain_rate: DrainRate,
                 retry_advisor: RetryAdvisor, service_s: Callable[[], float],
                 trace: TraceWriter | None, retry_budgets: RetryBudgets | None = None) -> None:
        self._config = config
        self._clock = clock
        self._metrics = metrics
        self._queue = queue
        self._tickets = tickets
        self._drain_rate = drain_rate
        self._retry_advisor = retry_advisor
        self._service_s = service_s
        self.trace = trace
        self._retry_budgets = retry_budgets

    def shed(self, cost: RequestCost, shed: Shed, headers: dict[str, str],
             enqueue_s: float | None) -> Rejection:
        """Count and trace a shed; the rejection to send."""
        now_s = self._clock()
        if shed.status < 500 and shed.status != 429:  # the policy says: never servable
            error = PricingError(shed.status, shed.reason, "This request can never be served "
                                 "as sent: it does not fit any replica.")
            return self.reject_early(cost.request_id, cost.tenant, cost.arrival_s,
                                     error, cost.request_class.name, counted=True)
        wait_s, why_not = self.advise(cost, shed, headers, now_s)
        message = (_UNAVAILABLE_MESSAGES.get(shed.reason) if shed.status == 503 else None) \
            or _SHED_MESSAGES.get(shed.status, _SHED_MESSAGES[503])
        if wait_s is None:
            message = _NO_RETRY_MESSAGES.get(why_not, _NO_RETRY_MESSAGES[None])
        rejection = Rejection(shed.status, shed.reason, message, wait_s, wait_s is not None,
                              None, cost.request_id)
        self._metrics.rejected(cost.request_class.name, cost.tenant, shed.reason).inc()
        if self.trace is not None:
            self.trace.write(rejection_record(cost.request_id, cost.tenant, cost.request_class.name,
                                               cost.arrival_s, now_s, enqueue_s, shed.status, shed.reason))
        return rejection

    def advise(self, cost: RequestCost, shed: Shed, headers: dict[str, str],
               now_s: float) -> tuple[float | None, str | None]:
        """The one place retry advice is computed: ``(the wait to advertise, None)``, or
        ``(None, why)`` for "do not retry": the policy says never or the reason is one a retry
        cannot help (why: the reason), the wait outlasts the client's own deadline (None), or
        retries would pass the retry budget (``retry_budget``)."""
        if not shed.should_retry or shed.reason in NEVER_RETRY:
            return None, shed.reason
        num_ahead = len(self._queue)
        service_s = self._service_s()
        wait_s = self._retry_advisor.retry_after_s(
            num_ahead=num_ahead, drain_rate_rps=self._drain_rate.rate_rps(now_s),
            policy_retry_after_s=shed.retry_after_s,
            expected_free_s=self._expected_free_s(now_s, num_ahead, service_s),
            num_in_flight=self._tickets.num_held, service_s=service_s,
            queue_horizon_s=self._queue_horizon_s(now_s) if num_ahead else None)
        # the headers were priced already: a malformed deadline header never gets here
        remaining_s = client_timeout_s(headers, self._config.deadline_header)
        if remaining_s is not None:
            remaining_s -= now_s - cost.arrival_s
        if not RetryAdvisor.should_retry(wait_s, remaining_s):
            return None, None
        if shed.status == 503 and self._retry_budgets is not None \
                and not self._retry_budgets.of(cost).advise_retry(cost.tenant, now_s):
            return None, RETRY_BUDGET  # retries would pass the budget: SDKs stop here
        return wait_s, None

    def deny(self, cost: RequestCost, reason: str, retry_after_s: float | None) -> Rejection:
        """The tenant's budget said no (429): a wait only when the store gave one."""
        self._metrics.rejected(cost.request_class.name, cost.tenant, reason).inc()
        if self.trace is not None:
            self.trace.write(rejection_record(cost.request_id, cost.tenant, cost.request_class.name,
                                               cost.arrival_s, self._clock(), None, 429, reason))
        return Rejection(429, reason, _LIMIT_MESSAGES.get(reason, _SHED_MESSAGES[429])
                         if retry_after_s is not None else
                         "This request exceeds the tenant's budget and can never fit it.",
                         retry_after_s, retry_after_s is not None, None, cost.request_id)

    def _queue_horizon_s(self, now_s: float) -> float:
        """Until every request queued now has left the queue: the latest ``until_s`` (past it
        a waiter is shed ``queue_timeout``; the policy may only bring it forward)."""
        return max(0.0, max(w.until_s for w in self._queue.waiters()) - now_s)

    def _expected_free_s(self, now_s: float, num_ahead: int, service_s: float) -> float | None:
        """When the ``num_ahead + 1``-th in-flight request is expected to finish, from each
        ticket's dispatch time and the measured service time; None with nothing in flight or
        more requests ahead than in flight (the turnover estimate covers that)."""
        dispatched_s = self._tickets.dispatch_times()
        if not dispatched_s or num_ahead >= len(dispatched_s):
            return None
        dispatched_s.sort()  # adding the same service time keeps the order
        return max(0.0, dispatched_s[num_ahead] + service_s - now_s)

    def reject_early(self, request_id: str, tenant: TenantConfig | str | None,
                     arrival_s: float, error: PricingError, class_name: str | None = None,
                     counted: bool = False) -> Rejection:
        """Never servable as sent (400/401/404/413): no budget, no blocks, never retry."""
        self.count_early(request_id, tenant, arrival_s, class_name, "rejected",
                         reason=error.reason, status=error.status, counted=counted)
        return Rejection(error.status, error.reason, error.message, None, False,
                         getattr(error, "param", None), request_id)

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
