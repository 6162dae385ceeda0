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
An app without ``/kvguard/state`` (404 or not JSON) becomes a healthy replica of unknown
capacity: the ``slo`` policy then admits a few requests at a time under its stale-state rule.

The pieces: :mod:`guard.relay` (forwarding and stream observation), :mod:`guard.release`
(the ticket release listeners), :mod:`guard.rejecter` (sheds and early rejections),
:mod:`guard.retry_ratio`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from guard.admission_queue import AdmissionQueue
from guard.background import Background
from guard.config import GuardConfig, TenantConfig, load_config
from guard.drain_rate import DrainRate
from guard.load_state import LoadState
from guard.metrics import GaugeValues, GuardMetrics
from guard.pricing import ClientDisconnected, Pricer, PricingError, headers_from_scope, read_body
from guard.rejecter import Rejecter
from guard.rejection import RetryAdvisor
from guard.relay import relay
from guard.release import ReleaseListeners
from guard.retry_ratio import RetryRatio
from guard.state_poller import AsgiStateSource, StatePoller
from guard.ticket import Ticket, TicketBook
from guard.trace import TraceWriter
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
_INVALID_KEY = ("invalid_api_key", "Incorrect or missing API key.")


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
        self.retry_advisor = RetryAdvisor(rng if rng is not None else random.Random())
        self.drain_rate = DrainRate()
        if trace is None and self.config.trace_path:
            trace = TraceWriter.open(self.config.trace_path)
        self.releases = ReleaseListeners(self.load_state, self.policy, self.metrics,
                                         self.drain_rate, self.pricer, self.queue, trace)
        self.tickets = TicketBook(self.clock, self.releases.listeners())
        self.rejecter = Rejecter(self.config, self.clock, self.metrics, self.queue, self.tickets,
                                 self.drain_rate, self.retry_advisor,
                                 lambda: self.releases.service_s, trace)
        self._retry_ratio = RetryRatio()
        self._anonymous = self.config.anonymous_tenant
        self._id_prefix = f"g-{os.urandom(3).hex()}-"
        self._next_id = itertools.count(1)
        self._limits = (None, 16)  # (max_model_len, block_size) from the latest snapshot
        self.background = Background(lambda: self.queue.run(self._decide),
                                     self._make_poller if self.poll_state else None,
                                     self._update_limits)

    @property
    def _trace(self) -> TraceWriter | None:
        return self.releases.trace

    @_trace.setter
    def _trace(self, trace: TraceWriter | None) -> None:
        self.releases.trace = self.rejecter.trace = trace

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
        if not self.background.is_running_here():
            await self.background.start()
        headers = headers_from_scope(scope)
        request_id = self._id_prefix + format(next(self._next_id), "x")
        tenant = self._tenant(headers.get("authorization"))
        if tenant is None:
            error = PricingError(401, *_INVALID_KEY)
            return await self.rejecter.reject_early(send, request_id, None, arrival_s, error)
        try:
            body = await read_body(receive, self.config.max_body_bytes, _content_length(headers))
            max_model_len, block_size = self._limits
            priced = self.pricer.price_request(body, scope["path"], headers, tenant, arrival_s,
                                               max_model_len=max_model_len, block_size=block_size,
                                               request_id=request_id)
        except PricingError as error:
            return await self.rejecter.reject_early(send, request_id, tenant, arrival_s, error)
        except ClientDisconnected:
            return self.rejecter.count_early(request_id, tenant, arrival_s, None, "canceled")
        cost = priced.cost
        class_name = cost.request_class.name
        counters = self.metrics.counters(class_name, cost.tenant)
        counters.offered.value += 1
        self._retry_ratio.record(cost.tenant, cost.is_retry)
        result = self._decide(cost, arrival_s)
        enqueue_s = pending = None
        if isinstance(result, Queue):
            enqueue_s = self.clock()
            result, pending = await self._wait(cost, result, receive, counters, enqueue_s)
            if result is None:
                return  # the client left while queued
        if isinstance(result, Shed):
            return await self.rejecter.shed(send, cost, result, headers, enqueue_s)
        result.enqueue_s = enqueue_s
        result.priced = priced
        await relay(self.app, scope, receive, send, body, result, pending, self.clock,
                    self.metrics.histograms(class_name).itl)

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
        self.metrics.counters(cost.request_class.name, cost.tenant).admitted.value += 1
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
        self.rejecter.count_early(cost.request_id, cost.tenant, cost.arrival_s,
                                  cost.request_class.name, "canceled", enqueue_s)

    # --- background work: state polling and the queue pump ---------------------------------
    @property
    def _tasks(self) -> list[asyncio.Task]:
        return self.background.tasks

    @property
    def _poller(self) -> StatePoller | None:
        return self.background.poller

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
        await self.background.aclose()
        if self._trace is not None:
            self._trace.flush()

    def close(self) -> None:
        """Final: flush and close the trace file."""
        if self._trace is not None:
            self._trace.close()

    # --- the guard's own metrics ----------------------------------------------------------
    async def _send_metrics(self, send: Send) -> None:
        await self.metrics.send_response(send)

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


def _client_gone(listen: asyncio.Future) -> bool:
    if not listen.done() or listen.cancelled():
        return False
    return listen.exception() is not None or listen.result()["type"] == "http.disconnect"
