"""What the guard does when a ticket is released: the :class:`~guard.admission.ticket.TicketBook` listeners.

In order: free the request's load-state reservation; give the policy its
:class:`~policies.decision.CompletionSample` (only when the policy learns from completions:
``observes_completions``, default true); count the outcome and latencies in the metrics; learn
(drain rate, the service-time EWMA behind Retry-After, the pricer's chars-per-token and output
length from the upstream's ``usage``); wake the admission queue and write the trace line.
"""

from __future__ import annotations

from typing import Any

from guard.admission.queue import AdmissionQueue
from guard.admission.shedding import DrainRate
from guard.admission.ticket import ReleaseListener, Ticket
from guard.observe.metrics import GuardMetrics
from guard.observe.trace import TraceWriter, ticket_record
from guard.replicas.load_state import LoadState
from guard.request.pricing import Pricer

__all__ = ["ReleaseListeners", "SERVICE_EWMA_WEIGHT"]

SERVICE_EWMA_WEIGHT = 0.1  # weight of each completion in the dispatch → release EWMA


class ReleaseListeners:
    """The release listeners over the guard's components; ``service_s`` is what they learned
    about how long an admitted request holds its ticket (the Retry-After fallback)."""

    def __init__(self, load_state: LoadState, policy: Any, metrics: GuardMetrics,
                 drain_rate: DrainRate, pricer: Pricer, queue: AdmissionQueue,
                 trace: TraceWriter | None) -> None:
        self._load_state = load_state
        self._policy = policy
        self._metrics = metrics
        self._drain_rate = drain_rate
        self._pricer = pricer
        self._queue = queue
        self.trace = trace
        self.service_s = 1.0  # EWMA of dispatch → release

    def listeners(self) -> tuple[ReleaseListener, ...]:
        observe = (self.observe,) if getattr(self._policy, "observes_completions", True) else ()
        return (self.free, *observe, self._metrics.on_released, self.learn, self.after_release)

    def free(self, ticket: Ticket) -> None:
        self._load_state.release(ticket.cost.request_id)

    def observe(self, ticket: Ticket) -> None:
        self._policy.observe(ticket.sample())

    def learn(self, ticket: Ticket) -> None:
        now_s = ticket.released_s
        self._drain_rate.record(now_s)
        if ticket.outcome != "completed":
            if ticket.num_content_chunks and ticket.priced is not None and ticket.outcome in (
                    "canceled", "failed"):  # a stream cut short: its length is a lower bound
                self._pricer.observe_abandoned(ticket.priced, ticket.num_content_chunks, now_s)
            return
        self.service_s += SERVICE_EWMA_WEIGHT * (now_s - ticket.dispatch_s - self.service_s)
        if ticket.priced is not None and ticket.ok:
            output = ticket.num_usage_output_tokens
            if output is None and ticket.is_stream:
                output = ticket.num_content_chunks
            self._pricer.observe_completion(ticket.priced, ticket.num_usage_prompt_tokens, output,
                                            now_s)

    def after_release(self, ticket: Ticket) -> None:
        self._queue.wake()
        if self.trace is not None:
            decision = "admit" if ticket.enqueue_s is None else "queue"
            decision_s = ticket.enqueue_s if ticket.enqueue_s is not None else ticket.dispatch_s
            meter = self._metrics.cost
            price = meter.config.network_usd_per_byte if meter is not None else 0.0
            self.trace.write(ticket_record(ticket, decision, decision_s, ticket.enqueue_s, price))
