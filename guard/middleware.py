"""``AdmissionMiddleware``: the guard as pure ASGI middleware in front of any ASGI app.

Only ``POST /v1/completions`` and ``POST /v1/chat/completions`` are admitted; everything else
(``/health``, ``/v1/models``, ``/kvguard/state``, ``/metrics``) passes straight through. The
guard's own Prometheus metrics are served at ``/kvguard/metrics``; ``/metrics`` goes to the
wrapped app first (an engine serves its vLLM-named metrics there) and the guard answers it only
when the wrapped app says 404.

Per request (all state in locals): tenant from ``Authorization: Bearer`` (401 when unknown and
anonymous is not allowed) → bounded body read (413) → price (400/413) → policy decision on a
fresh load snapshot → admit (reserve, issue a ticket, forward with ``x-request-id``), queue
(wait in the admission queue, watching for the client's disconnect) or shed (429/503 with
Retry-After). The forwarded response streams through unbuffered; the ticket is released
exactly once when the stream ends, the client disconnects, or the app raises (re-raised).
A disconnect reaches the wrapped app as ``http.disconnect``, which is how an in-process engine
learns to abort the sequence.

In-process mode (no replicas configured): the wrapped app is the one replica, ``local``, whose
``/kvguard/state`` is polled through the app itself by a ``StatePoller`` started on the first
request (or at ASGI lifespan startup, when the server sends lifespan through the middleware).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from guard.admission_queue import AdmissionQueue
from guard.config import GuardConfig, TenantConfig, load_config
from guard.drain_rate import DrainRate
from guard.load_state import AsgiStateSource, LoadState, StatePoller
from guard.metrics import CONTENT_TYPE_LATEST, GaugeValues, GuardMetrics
from guard.pricing import ClientDisconnected, Pricer, PricingError, headers_from_scope, read_body
from guard.rejection import Rejection, RetryAdvisor, send_rejection
from guard.ticket import Ticket, TicketBook
from guard.trace import TraceWriter, rejection_record, ticket_record
from policies import make_policy
from policies.cost import RequestCost
from policies.decision import Admit, Queue, Shed

__all__ = ["AdmissionMiddleware", "ADMITTED_PATHS", "GUARD_METRICS_PATH", "LOCAL_REPLICA"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
GUARD_METRICS_PATH = "/kvguard/metrics"
LOCAL_REPLICA = "local"
_REQUEST_ID = b"x-request-id"
_SHED_MESSAGES = {
    429: "Rate limit reached for this tenant; retry after the indicated time.",
    503: "The service is overloaded; retry after the indicated time.",
}


class _RetryRatio:
    """Per-tenant share of retries over each tenant's most recent ``window`` requests."""

    def __init__(self, window: int = 50) -> None:
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


class AdmissionMiddleware:
    """Pure ASGI admission control. See the module docstring for the flow.

    Collaborators may be injected (tests, the bench, the proxy): ``policy``, ``load_state``
    (then no poller runs unless ``poll_state=True``), ``pricer``, ``rng`` (Retry-After jitter),
    ``trace`` (a :class:`~guard.trace.TraceWriter`). Without ``config`` the configuration comes
    from ``KVGUARD_CONFIG`` / ``KVGUARD_*``.
    """

    def __init__(self, app: Callable, config: GuardConfig | None = None, *,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] | None = None,
                 tokenizer: Callable[[str], int] | None = None, policy: Any = None,
                 load_state: LoadState | None = None, pricer: Pricer | None = None,
                 rng: random.Random | None = None, trace: TraceWriter | None = None,
                 poll_state: bool | None = None) -> None:
        self.app = app
        self.config = config if config is not None else load_config()
        self.clock = clock or time.monotonic
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GuardMetrics(self.registry, self.config.max_tenant_labels)
        self.metrics.gauges = self._gauge_values
        self.policy = policy if policy is not None else make_policy(
            self.config.policy, **self.config.policy_params)
        self.poll_state = load_state is None if poll_state is None else poll_state
        self.load_state = load_state if load_state is not None else LoadState(self.config.max_staleness_s)
        self.pricer = pricer if pricer is not None else Pricer(self.config, tokenizer)
        self.queue = AdmissionQueue(self.config.max_queue_len, self.clock)
        self.tickets = TicketBook(self.clock, self._release_listeners())
        self.retry_advisor = RetryAdvisor(rng if rng is not None else random.Random())
        self.drain_rate = DrainRate()
        self._trace = trace
        if trace is None and self.config.trace_path:
            self._trace = TraceWriter.open(self.config.trace_path)
        self._retry_ratio = _RetryRatio()
        self._anonymous = self.config.anonymous_tenant
        self._id_prefix = f"g-{os.urandom(3).hex()}-"
        self._next_id = itertools.count(1)
        self._service_s = 1.0  # EWMA of dispatch → release, the Retry-After fallback
        self._limits = (None, 16)  # (max_model_len, block_size) from the latest snapshot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._ready: asyncio.Future | None = None
        self._poller: StatePoller | None = None

    # --- dispatch by scope ----------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path in ADMITTED_PATHS and scope["method"] == "POST":
                return await self._admit(scope, receive, send)
            if path == GUARD_METRICS_PATH:
                return await self._send_metrics(send)
            if path == "/metrics":
                return await self._metrics_fallback(scope, receive, send)
        elif kind == "lifespan":
            return await self.app(scope, self._lifespan_receive(receive), send)
        await self.app(scope, receive, send)

    # --- admission ------------------------------------------------------------------------
    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival_s = self.clock()
        ready = self._ready
        if ready is None or not ready.done() or self._loop is not asyncio.get_running_loop():
            await self._start()
        headers = headers_from_scope(scope)
        request_id = self._id_prefix + format(next(self._next_id), "x")
        tenant = self._tenant(headers.get("authorization"))
        if tenant is None:
            error = PricingError(401, "invalid_api_key", "Incorrect or missing API key.")
            return await self._reject_early(send, request_id, None, arrival_s, error)
        try:
            body = await read_body(receive, self.config.max_body_bytes, _content_length(headers))
            max_model_len, block_size = self._limits
            priced = self.pricer.price_request(body, scope["path"], headers, tenant, arrival_s,
                                               max_model_len=max_model_len, block_size=block_size,
                                               request_id=request_id)
        except PricingError as error:
            return await self._reject_early(send, request_id, tenant, arrival_s, error)
        except ClientDisconnected:
            return self._count_early(request_id, tenant, arrival_s, None, "canceled")
        cost = priced.cost
        counters = self.metrics.counters(cost.request_class.name, cost.tenant)
        counters.offered.inc()
        self._retry_ratio.record(cost.tenant, cost.is_retry)
        result = self._decide(cost, arrival_s)
        enqueue_s = pending = None
        if isinstance(result, Queue):
            enqueue_s = self.clock()
            result, pending = await self._wait(cost, result, receive, counters, enqueue_s)
            if result is None:
                return  # the client left while queued
        if isinstance(result, Shed):
            return await self._shed(send, cost, result, headers, enqueue_s)
        result.enqueue_s = enqueue_s
        result.priced = priced
        await self._forward(scope, receive, send, body, result, pending)

    def _tenant(self, authorization: str | None) -> TenantConfig | None:
        """``config.resolve_tenant`` with the anonymous tenant built once."""
        config = self.config
        tenant = config.match_tenant(_bearer(authorization)) if config.tenants else None
        if tenant is None and (config.allow_anonymous or not config.tenants):
            return self._anonymous
        return tenant

    def _decide(self, cost: RequestCost, now_s: float) -> Ticket | Queue | Shed:
        """Decide on a fresh snapshot; on admit take the reservation and issue the ticket."""
        snapshot = self.load_state.snapshot(now_s, len(self.queue), self.drain_rate.rate_rps(now_s),
                                            self._retry_ratio.ratios)
        decision = self.policy.decide(cost, snapshot)
        if not isinstance(decision, Admit):
            return decision
        replica_id = decision.replica_id
        self.load_state.reserve(replica_id, cost.request_id, cost, now_s)
        self.policy.admitted(cost, replica_id, now_s)
        self.metrics.counters(cost.request_class.name, cost.tenant).admitted.inc()
        return self.tickets.issue(cost, replica_id, now_s, decision.predicted_ttft_s)

    async def _wait(self, cost: RequestCost, queued: Queue, receive: Receive, counters: Any,
                    enqueue_s: float) -> tuple[Ticket | Shed | None, asyncio.Task | None]:
        """Wait in the queue while watching for the client's disconnect.

        Returns (ticket or shed, the pending ``receive()`` task to hand on) or (None, None)
        when the client went away.
        """
        waiter = self.queue.push(cost, queued.until_s, enqueue_s)
        if isinstance(waiter, Shed):
            return waiter, None
        counters.queued.inc()
        listen = asyncio.ensure_future(receive())
        try:
            while True:
                await asyncio.wait((waiter.future, listen), return_when=asyncio.FIRST_COMPLETED)
                if _client_gone(listen) or waiter.future.done():
                    break
                listen = asyncio.ensure_future(receive())  # a stray message: keep listening
        except BaseException:
            self._leave_queue(waiter, listen, cost, enqueue_s)
            raise
        self.metrics.histograms(cost.request_class.name).queue_wait.observe(self.clock() - enqueue_s)
        if _client_gone(listen):
            self._leave_queue(waiter, listen, cost, enqueue_s)
            return None, None
        return waiter.future.result(), listen

    def _leave_queue(self, waiter: Any, listen: asyncio.Future, cost: RequestCost,
                     enqueue_s: float) -> None:
        """The queued client went away (or our task was cancelled): nothing may leak."""
        self.queue.remove(waiter)
        if not listen.done():
            listen.cancel()
        future = waiter.future
        if future.done() and not future.cancelled() and isinstance(future.result(), Ticket):
            future.result().enqueue_s = enqueue_s
            future.result().release("canceled")
            return
        future.cancel()
        self._count_early(cost.request_id, cost.tenant, cost.arrival_s, cost.request_class.name,
                          "canceled", enqueue_s)

    # --- forwarding -----------------------------------------------------------------------
    async def _forward(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                       ticket: Ticket, pending: asyncio.Future | None) -> None:
        """Run the wrapped app; stream its response through; release the ticket once."""
        request_id = ticket.request_id.encode()
        inner_scope = dict(scope)
        inner_scope["headers"] = [h for h in scope["headers"] if h[0] != _REQUEST_ID]
        inner_scope["headers"].append((_REQUEST_ID, request_id))
        queue_ms = f"{(ticket.dispatch_s - ticket.cost.arrival_s) * 1000:.1f}".encode()
        first = {"type": "http.request", "body": body, "more_body": False}
        clock, itl = self.clock, self.metrics.histograms(ticket.cost.request_class.name).itl

        async def inner_receive() -> Message:
            nonlocal first, pending
            if first is not None:
                message, first = first, None
                return message
            if pending is not None:
                task, pending = pending, None
                message = await task
            else:
                message = await receive()
            if message["type"] == "http.disconnect":
                ticket.client_disconnected = True
            return message

        async def inner_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.body":
                gap_s = ticket.on_body(message.get("body", b""), message.get("more_body", False), clock())
                if gap_s is not None:
                    itl.observe(gap_s)
            elif kind == "http.response.start":
                message = _start_with_headers(message, ticket, request_id, queue_ms)
            try:
                await send(message)
            except OSError:
                ticket.client_disconnected = True
                raise

        try:
            await self.app(inner_scope, inner_receive, inner_send)
        except BaseException as exc:
            gone = ticket.client_disconnected or isinstance(exc, asyncio.CancelledError)
            ticket.release("canceled" if gone else "failed")
            raise
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
        ticket.release(ticket.natural_outcome())

    # --- rejections -----------------------------------------------------------------------
    async def _shed(self, send: Send, cost: RequestCost, shed: Shed, headers: dict[str, str],
                    enqueue_s: float | None) -> None:
        now_s = self.clock()
        if shed.status < 500 and shed.status != 429:  # the policy says: never servable
            error = PricingError(shed.status, shed.reason, "This request can never be served "
                                 "as sent: it does not fit any replica.")
            return await self._reject_early(send, cost.request_id, cost.tenant, cost.arrival_s,
                                            error, cost.request_class.name, counted=True)
        wait_s = self.retry_advisor.retry_after_s(
            num_ahead=len(self.queue), drain_rate_rps=self.drain_rate.rate_rps(now_s),
            policy_retry_after_s=shed.retry_after_s,
            expected_free_s=self._expected_free_s(now_s, len(self.queue)),
            fallback_s=self._service_s)
        remaining_s = _client_timeout_s(headers, self.config.deadline_header)
        if remaining_s is not None:
            remaining_s -= now_s - cost.arrival_s
        should_retry = shed.should_retry and RetryAdvisor.should_retry(wait_s, remaining_s)
        message = _SHED_MESSAGES.get(shed.status, _SHED_MESSAGES[503])
        rejection = Rejection(shed.status, shed.reason, message, wait_s, should_retry)
        self.metrics.rejected(cost.request_class.name, cost.tenant, shed.reason).inc()
        if self._trace is not None:
            self._trace.write(rejection_record(cost.request_id, cost.tenant, cost.request_class.name,
                                               cost.arrival_s, now_s, enqueue_s, shed.status, shed.reason))
        await send_rejection(send, rejection)

    def _expected_free_s(self, now_s: float, num_ahead: int) -> float | None:
        """When the ``num_ahead + 1``-th in-flight request is expected to finish, from each
        ticket's dispatch time and the measured service time; None with nothing in flight."""
        held = self.tickets.held()
        if not held:
            return None
        finishes_s = sorted(t.dispatch_s + self._service_s for t in held)
        index = min(num_ahead, len(finishes_s) - 1)
        return max(0.0, finishes_s[index] - now_s)

    async def _reject_early(self, send: Send, request_id: str, tenant: TenantConfig | str | None,
                            arrival_s: float, error: PricingError, class_name: str | None = None,
                            counted: bool = False) -> None:
        """Never servable as sent (400/401/413): no budget, no blocks, never retry."""
        self._count_early(request_id, tenant, arrival_s, class_name, "rejected",
                          reason=error.reason, status=error.status, counted=counted)
        rejection = Rejection(error.status, error.reason, error.message, None, False,
                              getattr(error, "param", None))
        await send_rejection(send, rejection)

    def _count_early(self, request_id: str, tenant: TenantConfig | str | None, arrival_s: float,
                     class_name: str | None, outcome: str, enqueue_s: float | None = None,
                     reason: str = "client_disconnected", status: int = 499,
                     counted: bool = False) -> None:
        """Count (and trace) a request that ended without a ticket."""
        if isinstance(tenant, TenantConfig):
            class_name = class_name or tenant.default_class
            tenant = tenant.name
        tenant_name = tenant or "unknown"
        class_name = class_name or self.config.default_class
        if enqueue_s is None and not counted:  # priced requests were counted as offered
            self.metrics.counters(class_name, tenant_name).offered.inc()
        if outcome == "rejected":
            self.metrics.rejected(class_name, tenant_name, reason).inc()
        else:
            self.metrics.counters(class_name, tenant_name).canceled.inc()
        if self._trace is not None:
            self._trace.write(rejection_record(request_id, tenant_name, class_name, arrival_s,
                                               self.clock(), enqueue_s, status, reason, outcome))

    # --- release --------------------------------------------------------------------------
    def _release_listeners(self) -> tuple:
        return (self._free, self._observe, self.metrics.on_released, self._learn,
                self._after_release)

    def _free(self, ticket: Ticket) -> None:
        self.load_state.release(ticket.request_id)

    def _observe(self, ticket: Ticket) -> None:
        self.policy.observe(ticket.sample())

    def _learn(self, ticket: Ticket) -> None:
        now_s = ticket.released_s
        self.drain_rate.record(now_s)
        if ticket.outcome != "completed":
            return
        self._service_s += 0.1 * (now_s - ticket.dispatch_s - self._service_s)
        if ticket.priced is not None and ticket.ok:
            output = ticket.num_usage_output_tokens
            if output is None and ticket.is_stream:
                output = ticket.num_content_chunks
            self.pricer.observe_completion(ticket.priced, ticket.num_usage_prompt_tokens, output)

    def _after_release(self, ticket: Ticket) -> None:
        self.queue.wake()
        if self._trace is not None:
            decision = "admit" if ticket.enqueue_s is None else "queue"
            decision_s = ticket.enqueue_s if ticket.enqueue_s is not None else ticket.dispatch_s
            self._trace.write(ticket_record(ticket, decision, decision_s, ticket.enqueue_s))

    # --- background work: state polling and the queue pump ---------------------------------
    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._ready is not None:
            await asyncio.shield(self._ready)
            return
        if self._loop is not None:  # a new event loop: what ran on the old one is gone
            self._poller = None
        self._loop, self._ready = loop, loop.create_future()
        self._tasks = [loop.create_task(self.queue.run(self._decide))]
        try:
            if self.poll_state:
                self._poller = self._poller or self._make_poller()
                await self._poller.refresh_now()
                self._poller.start()
            self._update_limits()
        finally:
            self._ready.set_result(None)

    def _make_poller(self) -> StatePoller:
        source = AsgiStateSource(self.app)
        return StatePoller(self.load_state, {LOCAL_REPLICA: source}, self.config.refresh_interval_s,
                           clock=self.clock, timeout_s=self.config.state_timeout_s,
                           unhealthy_after_errors=self.config.unhealthy_after_errors,
                           on_refresh=self._on_state_refresh)

    def _on_state_refresh(self) -> None:
        self._update_limits()
        self.queue.wake()

    def _update_limits(self) -> None:
        replicas = self.load_state.snapshot(self.clock()).replicas
        lengths = [r.max_model_len for r in replicas if r.max_model_len > 0]
        if replicas:
            self._limits = (min(lengths) if lengths else None, replicas[0].block_size)

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message
        return wrapped

    async def aclose(self) -> None:
        """Stop the poller and the queue pump, flush the trace. Safe to call twice."""
        if self._loop is not asyncio.get_running_loop():  # they ran on a loop that is gone
            self._poller, self._tasks = None, []
        if self._poller is not None:
            await self._poller.stop()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = self._ready = None
        if self._trace is not None:
            self._trace.flush()

    def close(self) -> None:
        """Final: flush and close the trace file."""
        if self._trace is not None:
            self._trace.close()

    # --- the guard's own metrics ----------------------------------------------------------
    async def _send_metrics(self, send: Send) -> None:
        body = self.metrics.render()
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                   (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _gauge_values(self) -> GaugeValues:
        replicas = self.load_state.snapshot(self.clock()).replicas
        return GaugeValues(len(self.queue), self.tickets.num_held,
                           {r.replica_id: r.num_free_blocks for r in replicas},
                           {r.replica_id: r.num_reserved_blocks for r in replicas})

    async def _metrics_fallback(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/metrics``: the wrapped app's if it has one, else the guard's."""
        missing = False

        async def inner_send(message: Message) -> None:
            nonlocal missing
            if message["type"] == "http.response.start" and message["status"] == 404:
                missing = True
            if not missing:
                await send(message)

        await self.app(scope, receive, inner_send)
        if missing:
            await self._send_metrics(send)


# --- helpers -----------------------------------------------------------------------------
def _bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def _client_timeout_s(headers: dict[str, str], deadline_header: str) -> float | None:
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


def _client_gone(listen: asyncio.Future) -> bool:
    if not listen.done() or listen.cancelled():
        return False
    return listen.exception() is not None or listen.result()["type"] == "http.disconnect"


def _start_with_headers(message: Message, ticket: Ticket, request_id: bytes,
                        queue_ms: bytes) -> Message:
    """Note the status and content type; add the guard's headers (ASGI names are lower-case)."""
    headers = list(message.get("headers", ()))
    content_type = b""
    has_request_id = False
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == _REQUEST_ID:
            has_request_id = True
    ticket.on_start(message["status"], content_type)
    headers.append((b"x-kvguard-queue-ms", queue_ms))
    if not has_request_id:
        headers.append((_REQUEST_ID, request_id))
    return {**message, "headers": headers}
