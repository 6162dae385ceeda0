"""``AdmissionController``: the whole admission flow, behind every front end (no ASGI here).

Per request: tenant (its API key) → body → price → tenant budget reserve (when a budget store
is configured) → policy decision on a fresh load snapshot → admit (the replica's blocks
reserved and the ticket issued together) | queue (wait, watching for the client to leave) |
shed (429/503 with retry advice) → the adapter relays → release exactly once. The controller
also owns the background work (state poller, queue pump, trace flush, budget lease renewal),
the metrics and the trace.

ADAPTER CONTRACT (``guard.middleware`` is one adapter, the standalone proxy another)::

    controller = AdmissionController(config, sources, registry=..., budget=...)
    request = AdmissionRequest(path, headers, body, client_gone)  # or await read_request(...)
    result = controller.decide(request)
    if isinstance(result, Wait):
        result = await controller.wait(result)
    # Admitted: forward it; Rejection: send it; None: the client left, nothing to send

* :class:`~guard.admission.request.AdmissionRequest`: ``path`` (the adapter decides which
  paths are admitted, with :meth:`GuardConfig.is_admitted_path`); ``headers``: lower-case
  names → values (:func:`guard.request.body.headers_from_scope` for ASGI); ``body``: the whole
  body, read under ``config.max_body_bytes`` (or ``unread``: the
  :class:`~guard.errors.BodyTooLarge` / :class:`~guard.errors.ClientDisconnected` that stopped
  reading it; :func:`~guard.admission.request.read_request` builds either); ``client_gone()``:
  one future (the same on every call, made on first use) that completes when the client
  disconnects. The controller watches it only while the request waits in the queue and
  never consumes it, so the adapter can keep watching it later. ``api_key``: the tenant's
  key, read from ``Authorization: Bearer``.
* ``decide(request)`` is synchronous (an adapter that holds the whole body can decide and
  write the request upstream in the same callback, with no task in between) and returns one
  of:
  - :class:`~guard.admission.admitted.Admitted`: decided, the replica reservation booked, the
    admit counted, the ticket issued. Forward ``admitted.body`` to ``admitted.replica_id``
    with ``x-request-id: admitted.request_id``; report ``on_start(status, content_type)``,
    ``on_body(chunk, more_body)`` for every chunk in the order the client gets them (first
    token, each inter-token gap, ``usage`` and ``finish_reason`` are read from the chunks),
    ``on_disconnect()`` when the client leaves; then call ``finish()`` (or ``finish(exc)``
    when relaying, or writing the request upstream, raised) exactly once. Outcomes:
    completed (whole 2xx, not aborted), canceled (client left, or the adapter's task was
    cancelled), failed (error, truncated, ``finish_reason`` abort/error), rejected_upstream
    (upstream 4xx).
  - :class:`~guard.admission.shedding.Rejection`: send it as is (status, OpenAI-style body,
    retry headers); it is already counted and traced.
  - :class:`~guard.admission.wait.Wait`: the decision needs waiting (start-up, the budget
    store's answer, the other guards' confirmation, the queue). Nothing else may be done with
    it than ``await wait(it)``, exactly once.
* ``await wait(waiting)`` returns :class:`Admitted` or :class:`Rejection` as above, or
  ``None``: the client left before a decision (already counted canceled; nothing to send).
* ``replicas_for`` (the proxy sets it): ``model -> frozenset of replica ids | None``, or
  PricingError (404 ``model_not_found``); each priced request is then decided only among its
  model's replicas (``RequestCost.replica_ids``), the queue pump's and redispatch's decisions
  included, checked against that model's context length
  (:meth:`~guard.admission.replica_limits.ReplicaLimits.rules_for`) and counted against that
  model's retry budget (:mod:`guard.admission.retry_budgets`).
* ``redispatch(admitted, replica_ids)`` (the proxy): the upstream failed before answering, so
  the policy re-decides among ``replica_ids``; returns the new replica id (reservation moved)
  or None.
* Drain (SIGTERM): :meth:`begin_drain` makes every decision, queued ones included, a 503
  ``shutting_down`` with retry advice; :meth:`wait_drained` returns once no ticket is held.
* Lifecycle: :meth:`start` on the serving event loop (a ``decide`` before it returns a
  ``Wait`` that starts it); :meth:`aclose` stops the background work, waits for budget
  settlements and flushes the trace; :meth:`close` closes the trace file.

Because an admission is booked inside ``decide``, before the loop runs anything else, the next
decision always sees it: no two decisions take the same capacity.

Building one: in-process (one local ASGI replica) pass
``sources={"local": AsgiStateSource(app)}``; for URL replicas use
:meth:`AdmissionController.for_replicas`, which makes one
:class:`~guard.replicas.poller.HttpStateSource` per :class:`~guard.config.ReplicaConfig`
(``state_source`` ``kvguard`` → ``/kvguard/state``, ``vllm`` → ``/metrics``, ``none`` → unknown
capacity, never polled over the network). ``sources=None`` means the caller feeds
``load_state`` itself (tests, benchmarks). Health, ejection and the HTTP relay belong to the
proxy on top.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.background import Background
from guard.admission.budget_grants import BudgetGrants
from guard.admission.decider import Decider
from guard.admission.queue import AdmissionQueue
from guard.admission.queue_wait import QueueWait
from guard.admission.release import ReleaseListeners
from guard.admission.replica_limits import ReplicaLimits
from guard.admission.request import AdmissionRequest, bearer_token
from guard.admission.retry_budgets import RetryBudgets
from guard.admission.shedding import DrainRate, Rejecter, Rejection, RetryAdvisor
from guard.admission.ticket import TicketBook
from guard.admission.wait import BUDGET, CLIENT_LEFT, CONFIRMATION, QUEUE, STARTING, Wait
from guard.budget.factory import build_budget_store
from guard.budget.store import BudgetStore, Denied, Grant
from guard.config import GuardConfig, TenantConfig
from guard.errors import PricingError
from guard.observe.cost_meter import CostMeter
from guard.observe.loop_lag import LoopLag
from guard.observe.metrics import GaugeValues, GuardMetrics
from guard.observe.trace import TraceWriter
from guard.replicas.learned_limits import LearnedLimits
from guard.replicas.load_state import LoadState
from guard.replicas.poller import StatePoller, StateSource
from guard.replicas.prefix_cache_feed import PrefixCacheFeed
from guard.replicas.shared_reservations import SharedReservations
from guard.request.pricing import PricedRequest, Pricer, tokenizer_counter
from guard.request.rules import ReplicaRules
from policies import make_policy
from policies.concurrency_limit import ConcurrencyLimit
from policies.cost import RequestCost
from policies.decision import Admit, Queue, Shed
from policies.snapshot import QueuedAhead

__all__ = ["AdmissionController", "INVALID_KEY"]

_log = logging.getLogger(__name__)

INVALID_KEY = ("invalid_api_key", "Incorrect or missing API key.")
Headers = Mapping[str, str]


class AdmissionController:
    """One guard's admission flow. See the module docstring for the adapter contract.

    Collaborators may be injected (tests, the bench): ``policy``, ``load_state``, ``pricer``,
    ``rng`` (Retry-After jitter), ``trace``, ``tokenizer`` (else ``config.tokenizer``),
    ``budget`` (a :class:`~guard.budget.store.BudgetStore`; None: the store the config asks for,
    see :func:`guard.budget.build_budget_store` — none at all when no tenant has a budget).
    """

    def __init__(self, config: GuardConfig, sources: Mapping[str, StateSource] | None = None, *,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] | None = None,
                 tokenizer: Callable[[str], int] | None = None, policy: Any = None,
                 load_state: LoadState | None = None, pricer: Pricer | None = None,
                 rng: random.Random | None = None, trace: TraceWriter | None = None,
                 budget: BudgetStore | None = None, budget_lease_s: float | None = None,
                 shared_reservations: SharedReservations | None = None) -> None:
        budget_lease_s = config.budget.lease_s if budget_lease_s is None else budget_lease_s
        if budget_lease_s <= 0:
            raise ValueError(f"budget_lease_s: must be > 0, got {budget_lease_s!r}")
        self.config = config
        self.clock = clock or time.monotonic
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GuardMetrics(self.registry, config.max_tenant_labels)
        self.metrics.gauges = self._gauge_values
        self.metrics.cost = CostMeter(config.cost, max(len(config.replicas), 1), clock=self.clock)
        self.metrics.loop_lag = self.loop_lag = LoopLag()
        self.policy = policy if policy is not None else make_policy(config.policy,
                                                                    **config.policy_params)
        self.load_state = load_state if load_state is not None else LoadState(
            config.max_staleness_s, weights={r.replica_id: r.weight for r in config.replicas})
        if tokenizer is None and config.tokenizer is not None:
            tokenizer = _tokenizer_from(config.tokenizer)
        self.pricer = pricer if pricer is not None else Pricer(config, tokenizer)
        self.prefix_cache = PrefixCacheFeed(config, self.load_state, self.pricer, self.registry,
                                            set(sources) if sources is not None else None)
        self.load_state.on_preemptions = lambda _replica, num: self.pricer.observe_preemptions(num)
        self.queue = AdmissionQueue(config.max_queue_len, self.clock)
        self.drain_rate = DrainRate()
        self.retry_budgets = RetryBudgets(config.retry_budget)  # one per model's replicas
        self.metrics.retry_counts = lambda: self.retry_budgets.counts(self.clock())
        if hasattr(self.policy, "client_patience"):  # the slo policy's learned patience
            self.metrics.client_patience = lambda: self.policy.client_patience(self.clock())
        if trace is None and config.trace_path:
            trace = TraceWriter.open(config.trace_path, clock=self.clock)
        self.releases = ReleaseListeners(self.load_state, self.policy, self.metrics,
                                         self.drain_rate, self.pricer, self.queue, trace)
        self.on_close: list[Callable[[], Awaitable[None]]] = []  # run by aclose (owned clients)
        if budget is None:  # the store the config asks for (None: no tenant has a budget)
            budget = build_budget_store(config, self.clock, self.registry)
            if budget is not None:
                self.on_close.append(budget.aclose)
        self.budget = budget
        self.grants = BudgetGrants(budget, budget_lease_s) if budget is not None else None
        listeners = self.releases.listeners()
        self.tickets = TicketBook(self.clock, listeners if self.grants is None else
                                  (*listeners, self.grants.on_released))
        # each replica's concurrency limit, learned from its responses (after the reservation
        # is freed: a listener added last); it starts at the policy's stale-state cap
        initial_limit = max(1, getattr(self.policy, "stale_max_inflight_per_replica", 4))
        self.learned_limits = LearnedLimits(self.load_state,
                                            lambda: ConcurrencyLimit(initial_limit))
        self.tickets.add_listener(self.learned_limits.on_released)
        self.rejecter = Rejecter(config, self.clock, self.metrics, self.queue, self.tickets,
                                 self.drain_rate,
                                 RetryAdvisor(rng if rng is not None else random.Random()),
                                 lambda: self.releases.service_s, trace, self.retry_budgets)
        self._anonymous = config.anonymous_tenant
        # ids are UUIDs (this guard's random first 24 characters, then a 12-hex-digit count):
        # some engines (llama-cpp-python's server) refuse an x-request-id that is not one
        self._id_prefix = str(uuid.uuid4())[:24]
        self._next_id = itertools.count(1)
        self.replica_limits = ReplicaLimits(
            self.load_state, min(c.itl_s for c in config.classes),
            {r.replica_id: r.max_model_len for r in config.replicas if r.max_model_len})
        self.rules = self.replica_limits.rules  # what the replicas accept, from their latest state
        self._sources = dict(sources) if sources is not None else None
        # model -> the replica ids serving it (None: any; PricingError: none), set by the proxy
        self.replicas_for: Callable[[object], frozenset[str] | None] | None = None
        self.shared = shared_reservations  # other guards' pending reservations, via Redis
        if shared_reservations is not None:
            shared_reservations.bind(self.load_state, self.registry, self.clock)
            self.on_close.append(shared_reservations.aclose)
        self.decider = Decider(self.policy, self.load_state, self.queue, self.drain_rate,
                               self.retry_budgets, self.metrics, self.clock, shared_reservations)
        self.waiting = QueueWait(self.queue, self.decider, self.metrics, self.clock, self.tickets,
                                 self.load_state, self.rejecter, config.max_queue_wait_s)
        self.background = Background(lambda: self.queue.run(self.decider.decide),
                                     self._make_poller if self._sources else None,
                                     self._update_limits, self._housekeeping)

    @classmethod
    def for_replicas(cls, config: GuardConfig, **kwargs: Any) -> AdmissionController:
        """A controller over ``config.replicas`` (URL replicas, polled over HTTP)."""
        import httpx

        from guard.replicas.poller import state_sources

        if not config.replicas:
            raise ValueError("replicas: at least one [[replicas]] entry is needed")
        client = httpx.AsyncClient()
        sources = state_sources(config.replicas, client, timeout_s=config.state_timeout_s,
                                stream_interval_s=config.refresh_interval_s)
        controller = cls(config, sources, **kwargs)
        controller.on_close.append(client.aclose)
        return controller

    @property
    def draining(self) -> bool:
        """Set by :meth:`begin_drain`: every decision sheds ``shutting_down``."""
        return self.decider.draining

    @property
    def trace(self) -> TraceWriter | None:
        return self.releases.trace

    @trace.setter
    def trace(self, trace: TraceWriter | None) -> None:
        self.releases.trace = self.rejecter.trace = trace

    # --- the flow ---------------------------------------------------------------------------
    def decide(self, request: AdmissionRequest) -> Admitted | Rejection | Wait:
        """Tenant, price, budget and the policy's decision, as far as it goes without waiting:
        see the module docstring."""
        if not self.background.is_running_here():
            return Wait(request, STARTING, partial(self._started_then_decided, request))
        arrival_s = self.clock()
        request_id = self._id_prefix + format(next(self._next_id), "012x")
        # no tenants configured: everyone is the anonymous tenant
        tenant = self._tenant_of(request.api_key) if self.config.tenants else self._anonymous
        if tenant is None:
            return self.rejecter.reject_early(request_id, None, arrival_s,
                                              PricingError(401, *INVALID_KEY))
        unread = request.unread
        if unread is not None:  # a 413, or the client left while sending its body
            if isinstance(unread, PricingError):
                return self.rejecter.reject_early(request_id, tenant, arrival_s, unread)
            self.rejecter.count_early(request_id, tenant, arrival_s, None, "canceled")
            return Wait(request, CLIENT_LEFT, _nothing)
        try:
            priced = self.pricer.price_request(request.body, request.path, request.headers,
                                               tenant, arrival_s, request_id=request_id,
                                               rules=self.rules, model_rules=(
                                                   None if self.replicas_for is None
                                                   else self._model_rules))
            cost = priced.cost
            if self.replicas_for is not None:  # only the replicas serving its model
                cost.replica_ids = self.replicas_for(priced.body.get("model"))
        except PricingError as error:
            return self.rejecter.reject_early(request_id, tenant, arrival_s, error)
        self.metrics.counters(cost.request_class.name, cost.tenant).offered.value += 1
        self.retry_budgets.of(cost).record(cost.tenant, cost.is_retry, arrival_s)
        grants = self.grants
        if grants is None:
            return self._decided(priced, request, None)
        # the tenant budget: answered at once when the store can
        outcome = grants.try_reserve(cost.tenant, cost.num_prompt_tokens + cost.max_tokens)
        if outcome is None:
            return Wait(request, BUDGET, partial(self._reserved_then_decided, priced, request))
        if isinstance(outcome, Denied):
            return self.rejecter.deny(cost, outcome.reason, outcome.retry_after_s)
        return self._decided(priced, request, outcome)

    def _model_rules(self, model: object) -> ReplicaRules:
        """What the replicas serving ``model`` accept (its context: the smallest among them).
        A model none serves gets the fleet's rules: its 404 comes from the body checks or from
        the routing after pricing, as without per-model rules."""
        try:
            replica_ids = self.replicas_for(model)
        except PricingError:
            return self.rules
        return self.replica_limits.rules_for(replica_ids, model)

    async def wait(self, waiting: Wait) -> Admitted | Rejection | None:
        """The decision a :class:`Wait` stood for (None: the client left first)."""
        then, waiting.then = waiting.then, None
        if then is None:
            raise RuntimeError(f"{waiting!r} was waited for already")
        return await then()

    async def _started_then_decided(self, request: AdmissionRequest
                                    ) -> Admitted | Rejection | None:
        await self.background.start()
        result = self.decide(request)
        return await self.wait(result) if isinstance(result, Wait) else result

    async def _reserved_then_decided(self, priced: PricedRequest, request: AdmissionRequest
                                     ) -> Admitted | Rejection | None:
        """The budget store's answer waited for, then the decision."""
        cost = priced.cost
        outcome = await self.grants.reserve(cost.tenant, cost.num_prompt_tokens + cost.max_tokens)
        if isinstance(outcome, Denied):
            return self.rejecter.deny(cost, outcome.reason, outcome.retry_after_s)
        result = self._decided(priced, request, outcome)
        return await self.wait(result) if isinstance(result, Wait) else result

    def _decided(self, priced: PricedRequest, request: AdmissionRequest,
                 grant: Grant | None) -> Admitted | Rejection | Wait:
        """The policy's decision: admitted (booked, ticketed) or shed at once, else what it
        waits for (the other guards' confirmation, the queue). The grant is dropped unless
        the request is admitted or waits."""
        cost = priced.cost
        try:
            decision, ahead = self.decider.decide_arrival(cost, cost.arrival_s)
            if isinstance(decision, Admit):
                if self.shared is None:
                    return self._admitted(priced, decision, None, grant)
                return Wait(request, CONFIRMATION,
                            partial(self._confirmed, priced, request, decision, ahead, grant))
        except BaseException:
            self._drop_grant(grant)
            raise
        if isinstance(decision, Shed):
            return self._shed(cost, decision, request.headers, grant, None)
        return Wait(request, QUEUE, partial(self._queued, priced, request, decision, grant))

    async def _confirmed(self, priced: PricedRequest, request: AdmissionRequest, decision: Admit,
                         ahead: QueuedAhead, grant: Grant | None) -> Admitted | Rejection | None:
        """Shared KV reservations: the admit confirmed against the other guards' (or decided
        again, which may queue or shed it)."""
        try:
            result = await self.decider.confirmed(priced.cost, decision, ahead)
            if isinstance(result, Admit):
                return self._admitted(priced, result, None, grant)
        except BaseException:
            self._drop_grant(grant)
            raise
        if isinstance(result, Shed):
            return self._shed(priced.cost, result, request.headers, grant, None)
        return await self._queued(priced, request, result, grant)

    async def _queued(self, priced: PricedRequest, request: AdmissionRequest, decision: Queue,
                      grant: Grant | None) -> Admitted | Rejection | None:
        """Waiting in the queue for the pump's decision, watching for the client to leave."""
        cost = priced.cost
        client_gone = request.client_gone
        try:
            result, enqueue_s = await self.waiting.outcome(cost, decision, client_gone)
        except BaseException:
            self._drop_grant(grant)
            raise
        if result is None:  # the client left while queued (already counted canceled)
            self._drop_grant(grant)
            return None
        if isinstance(result, Shed):
            return self._shed(cost, result, request.headers, grant, enqueue_s)
        admitted = self._admitted(priced, result, enqueue_s, grant)
        if client_gone is not None and client_gone().done():
            admitted.on_disconnect()  # admitted in the same instant the client left
        return admitted

    def _shed(self, cost: RequestCost, shed: Shed, headers: Headers, grant: Grant | None,
              enqueue_s: float | None) -> Rejection:
        """A shed decision, final: the grant dropped, the rejection counted and made."""
        self._drop_grant(grant)
        return self.rejecter.shed(cost, shed, headers, enqueue_s)

    def _admitted(self, priced: PricedRequest, admit: Admit, enqueue_s: float | None,
                  grant: Grant | None) -> Admitted:
        """The ticket issued on the reservation the decider booked, wrapped for the adapter."""
        cost = priced.cost
        reservation = self.load_state.reservation(cost.request_id)
        if reservation is None:  # every Admit reserves: a bug, never a request's fault
            raise RuntimeError(f"admitted request {cost.request_id} holds no reservation")
        ticket = self.tickets.issue(reservation, self.clock(), admit.predicted_ttft_s,
                                    enqueue_s, priced, grant)
        if self.releases.trace is not None:
            ticket.chunks_s = []  # when each content chunk went out, for the trace
        return Admitted(ticket, _forward_body(priced), self.clock,
                        self.metrics.histograms(cost.request_class.name).itl)

    def tenant(self, authorization: str | None) -> TenantConfig | None:
        """The tenant of an ``Authorization`` header, the anonymous tenant, or None (401)."""
        return self._tenant_of(bearer_token(authorization))

    def _tenant_of(self, api_key: str | None) -> TenantConfig | None:
        config = self.config
        tenant = config.match_tenant(api_key) if config.tenants else None
        if tenant is None and (config.allow_anonymous or not config.tenants):
            return self._anonymous
        return tenant

    def redispatch(self, admitted: Admitted, replica_ids: Collection[str]) -> str | None:
        """The policy re-decides an admitted request whose replica failed before answering
        (nothing reached the client) among ``replica_ids``. On Admit its reservation moves to
        the new replica (the ticket refers to it, so it follows) and ``admitted.replica_id``
        names it. None when the policy admits it nowhere: the reservation stays until the
        adapter answers the failure and the ticket is released."""
        replica_id = self.decider.redispatch(admitted, replica_ids)
        if replica_id is not None:
            admitted.replica_id = replica_id
        return replica_id

    def served_by(self, admitted: Admitted, replica_id: str) -> bool:
        """A gateway sent an admitted request to ``replica_id`` instead of its own replica (a
        fallback endpoint, after the first failed): its reservation moves there, the policy is
        told, and ``admitted.replica_id`` names it. False when it holds no reservation."""
        if replica_id == admitted.replica_id:
            return True
        now_s = self.clock()
        if not self.load_state.move(admitted.request_id, replica_id, now_s):
            return False
        self.policy.admitted(admitted.ticket.cost, replica_id, now_s)
        admitted.replica_id = replica_id
        return True

    # --- drain --------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Stop admitting (SIGTERM): new and queued requests are shed 503 ``shutting_down`` with
        retry advice; admitted requests run on."""
        self.decider.draining = True
        self.queue.wake()

    async def wait_drained(self, poll_s: float = 0.05) -> None:
        """Return once no admitted request holds a ticket (callers bound the wait)."""
        while self.tickets.num_held:
            await asyncio.sleep(poll_s)

    # --- budget grants ------------------------------------------------------------------------
    def _drop_grant(self, grant: Grant | None) -> None:
        """A grant whose request will never run: released."""
        if grant is not None:
            self.grants.drop(grant)

    async def _housekeeping(self) -> None:
        """Once a second: flush the trace; every budget lease / 3: renew held grants; all the
        while, sample the event loop's lag."""
        self.loop_lag.start()  # sampled while the guard runs
        try:
            await self._housekeep()
        finally:
            self.loop_lag.stop()

    async def _housekeep(self) -> None:
        while True:
            grants = self.grants
            await asyncio.sleep(1.0 if grants is None else min(1.0, grants.lease_s / 3))
            if self.trace is not None:
                self.trace.flush()
            if grants is not None:
                await grants.renew_if_due()

    # --- background work ------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the budget store's link (:meth:`open_budget`), start the queue pump, poll once,
        then start the poller (on the running loop)."""
        await self.open_budget()
        self.prefix_cache.start()
        if not self.background.is_running_here():
            await self.background.start()

    async def open_budget(self) -> None:
        """At start-up: a store with a remote backend (Redis) connects now, not on the first
        request, and this waits — bounded, never failing on Redis — until its first contact
        attempt ended (see :mod:`guard.budget.fallback`). Nothing for other stores."""
        open_store = getattr(self.budget, "open", None)
        if open_store is not None:
            await open_store()

    def state_error(self, replica_id: str) -> str | None:
        """Why the replica's state could not be read at its last refresh (None: it was)."""
        poller = self.background.poller
        return None if poller is None else poller.unreadable.get(replica_id)

    def add_source(self, replica_id: str, source: StateSource) -> None:
        """A replica joined the fleet: its state is polled from the next round."""
        if self._sources is None:
            raise ValueError("add_source: this controller polls no replicas")
        self._sources[replica_id] = source
        poller = self.background.poller
        if poller is not None:
            poller.add(replica_id, source)

    def remove_source(self, replica_id: str) -> None:
        """A replica left the fleet: no longer polled (its load state is the caller's)."""
        if self._sources is not None:
            self._sources.pop(replica_id, None)
        poller = self.background.poller
        if poller is not None:
            poller.remove(replica_id)

    def _make_poller(self) -> StatePoller:
        return StatePoller(self.load_state, self._sources, self.config.refresh_interval_s,
                           clock=self.clock, timeout_s=self.config.state_timeout_s,
                           unhealthy_after_errors=self.config.unhealthy_after_errors,
                           on_refresh=self._on_state_refresh)

    def _on_state_refresh(self) -> None:
        self._update_limits()
        self.queue.wake()

    def _update_limits(self) -> None:
        self.rules = self.replica_limits.update()

    async def aclose(self) -> None:
        """Stop the background work, let budget settlements finish, flush the trace."""
        await self.background.aclose()
        if self.grants is not None:
            await self.grants.aclose()
        for close in self.on_close:
            await close()
        self.on_close.clear()
        await self.prefix_cache.aclose()
        if self.trace is not None:
            self.trace.flush()

    def close(self) -> None:
        """Final: flush and close the trace file."""
        if self.trace is not None:
            self.trace.close()

    def _gauge_values(self) -> GaugeValues:
        replicas = self.load_state.snapshot(self.clock()).replicas
        return GaugeValues(len(self.queue), self.tickets.num_held,
                           {r.replica_id: r.num_free_blocks for r in replicas},
                           {r.replica_id: r.num_reserved_blocks for r in replicas},
                           self.learned_limits.values())


def _forward_body(priced: PricedRequest) -> bytes:
    """The body to send upstream: as the client sent it, unless ``max_tokens`` was filled in."""
    raw = priced.raw  # forward_body(), without the call when the body goes as sent
    return (raw if raw and not priced.max_tokens_defaulted and priced.cache_salt is None
            else priced.forward_body())


async def _nothing() -> None:
    """A client that left before its decision: nothing to wait for, nothing to send."""
    return None


def _tokenizer_from(path: str) -> Callable[[str], int]:
    try:
        return tokenizer_counter(path)
    except Exception as exc:  # noqa: BLE001 - a missing file or package, named for the user
        raise ValueError(f"tokenizer: cannot load {path!r}: {exc}") from None
