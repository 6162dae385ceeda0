"""``ProxyApp``: the standalone proxy as one ASGI app in front of N replicas over HTTP.

Routes:

* ``POST`` to an admitted path (``admitted_paths``; by default any path ending in
  ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/embeddings``):
  admission (tenant → price → policy → admit | queue | shed) and, once admitted,
  :class:`guard.proxy.upstream.Forwarder` relays the request to the replica the policy picked (``Admit(replica_id)``: for ``slo`` the lowest
  predicted TTFT where the request fits, least-loaded for the baselines). Bad input is answered
  here and never reaches a replica.
* Routing by model: a request is decided only among the replicas serving its ``model``
  (:class:`guard.proxy.model_catalog.ModelCatalog`: ``[[replicas]] models`` or each replica's
  ``/v1/models``); a model none serves is a 404 ``model_not_found`` that reaches no replica.
* ``GET /livez`` (liveness), ``GET /readyz`` and ``/health`` (readiness: a replica routable,
  not draining; else 503 with the reason), ``GET /kvguard/state`` (the proxy's view of every
  replica), ``GET /v1/models`` (the union of the routable replicas' lists):
  :class:`guard.proxy.status.ProxyStatus`.
* ``GET /kvguard/metrics``: the guard's and the proxy's Prometheus series.

With a ``redis_url`` (``--redis``) the proxy also shares its pending KV reservations with every
other proxy on that Redis (:mod:`guard.replicas.shared_reservations`): three proxies in front
of the same replicas admit no more than one would.

Each replica's load comes from its ``/kvguard/state`` (``state_source = "kvguard"``), its vLLM
``/metrics`` (``"vllm"``) or nowhere (``"none"``: unknown capacity), polled every
``refresh_interval_s``; :class:`guard.proxy.health.ReplicaHealth` ejects replicas that fail
requests and probes them back. ``drain()`` (SIGTERM) stops admitting: new requests get 503
``shutting_down`` while admitted ones finish.

The admission flow is :class:`guard.controller.AdmissionController`'s (this app is its second
adapter, beside the middleware). The app routes and owns the parts: the ASGI path reads the
request here (:class:`guard.proxy.exchange.AsgiExchange`); kvguard's server may instead hand an
admitted request over from its read callback (:class:`guard.proxy.direct.DirectPath`); both
answer through :class:`guard.proxy.responder.Responder`. The operational endpoints are gated
like the middleware's (:class:`guard.operational_access.OperationalAccess`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest, read_request
from guard.admission.shedding import Rejection, send_rejection
from guard.admission.wait import Wait
from guard.config import GuardConfig, ReplicaConfig
from guard.controller import AdmissionController
from guard.errors import BodyTooLarge, ClientDisconnected, PricingError
from guard.observe.access_log import with_access_log
from guard.operational_access import ADMIN_PATHS, MODELS_PATH, OperationalAccess
from guard.proxy.direct import DirectPath
from guard.proxy.exchange import AsgiExchange, send_json
from guard.proxy.h1_message import NOT_FORWARDED
from guard.proxy.health import ReplicaHealth
from guard.proxy.metrics import ProxyMetrics
from guard.proxy.model_catalog import ModelCatalog
from guard.proxy.passthrough import Passthrough
from guard.proxy.responder import Responder
from guard.proxy.state_client import TransportStateClient
from guard.proxy.status import LIVEZ_PATH, PROBE_PATHS, READYZ_PATH, ProxyStatus
from guard.proxy.transports import Transport, UpstreamError, make_transport
from guard.proxy.upstream import Forwarder
from guard.replicas.discovery import ReplicaWatcher, replica_source
from guard.replicas.membership import FleetMembership, start_fleet, stop_fleet
from guard.replicas.poller import state_sources
from guard.replicas.shared_polling import SharedStateSource, shards_for
from guard.replicas.shared_reservations import SharedReservations
from guard.request.body import content_length, headers_from_scope, read_body
from guard.request.request_ids import client_request_id
from guard.request.target import Target, scope_target

if TYPE_CHECKING:
    from serving.h1_exchange import Exchange
    from serving.h1_head import RequestHead

__all__ = ["LIVEZ_PATH", "ProxyApp", "READYZ_PATH"]

Message = dict[str, Any]
RawHeaders = list[tuple[bytes, bytes]]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_log = logging.getLogger(__name__)

GUARD_METRICS_PATH = "/kvguard/metrics"
SHARED_LEASE_MIN_S = 2.0  # a published reservation outlives its guard this long at least,
SHARED_LEASE_REFRESHES = 10  # and this many state refreshes (renewed every refresh)
_GATED_PATHS = ADMIN_PATHS | {MODELS_PATH}


class ProxyApp:
    """ASGI app of ``kvguard proxy``. ``transport``, ``registry`` and ``budget`` (a budget
    store; None: the controller builds what the config asks for) may be injected;
    ``access_log``: one ``kvguard.access`` line per request (:mod:`guard.observe.access_log`);
    ``state_source``: how replicas listed by ``replicas_from`` without one publish load (the
    CLI's ``--state-source``)."""

    def __init__(self, config: GuardConfig, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] | None = None, transport: Transport | None = None,
                 budget: Any = None, access_log: bool = False,
                 state_source: str = "auto") -> None:
        if not config.replicas or any(r.url is None for r in config.replicas):
            raise ValueError("replicas: the proxy needs at least one replica with a url "
                             "(--upstream URL or [[replicas]])")
        self.config = config
        self.clock = clock or time.monotonic
        proxy = config.proxy
        self.urls = {r.replica_id: r.url for r in config.replicas}
        self.transport = transport or make_transport(
            proxy.upstream_client, proxy.connect_timeout_s, proxy.read_timeout_s,
            proxy.max_connections_per_replica, len(self.urls))
        self.health = ReplicaHealth(self.urls, proxy.eject_after_failures, proxy.probe_interval_s,
                                    self._mark_unhealthy, self._probe, self.clock)
        # state polls ride the requests' pooled transport (no second client per replica)
        self._state_client = TransportStateClient(self.transport)
        sources = state_sources(config.replicas, self._state_client,
                                timeout_s=config.state_timeout_s,
                                stream_interval_s=config.refresh_interval_s)
        self.shards = shards_for(config)  # the proxies share the fleet's polling
        if self.shards is not None:
            sources = {rid: self._shared(self.urls[rid], source) for rid, source in sources.items()}
        self._sources = sources  # what each replica's state source found (``auto``)
        # the index of the next replica to join, for its state stream's phase (state_sources)
        self._next_phase_index = itertools.count(len(config.replicas))
        gated = {rid: self.health.gate(rid, source) for rid, source in sources.items()}
        shared = None
        if config.redis_url is not None:  # the same Redis as the budgets: KV reservations too
            shared = SharedReservations(
                config.redis_url, self.urls, timeout_s=config.budget.redis_timeout_s,
                lease_s=max(SHARED_LEASE_MIN_S, SHARED_LEASE_REFRESHES * config.refresh_interval_s),
                sync_interval_s=config.refresh_interval_s)
        self.controller = AdmissionController(config, gated, registry=registry, clock=self.clock,
                                              budget=budget, shared_reservations=shared)
        self.load_state = self.controller.load_state
        if access_log:  # one line per request, from the records the trace file gets
            self.controller.trace = with_access_log(self.controller.trace)
        self.metrics = ProxyMetrics(self.controller.registry, list(self.urls), self.routable,
                                    self.controller.state_error)
        self.forwarder = Forwarder(self.urls, self.transport, self.health, self._redispatch,
                                   self.metrics, {r.replica_id: r.api_key for r in config.replicas
                                                  if r.api_key is not None})
        # the client's Authorization is its tenant key: not the replica's business by default
        self._not_forwarded = NOT_FORWARDED if proxy.forward_client_authorization \
            else NOT_FORWARDED | {b"authorization"}
        self._access = OperationalAccess(config)
        self._is_admitted = config.is_admitted_path
        self.responder = Responder(config, self.controller, self.forwarder, self._not_forwarded)
        self._direct = DirectPath(config, self.controller, self.forwarder, self.responder)
        self.models = ModelCatalog(config.replicas)  # a request routes among its model's
        self.controller.replicas_for = self.models.replicas_for
        self.controller.replica_limits.model_context = self.models.max_model_len
        self.passthrough = Passthrough(proxy.relayed_paths, self.transport, self.urls,
                                       self._relay_replica, self._relay_headers,
                                       self.controller.registry, proxy.read_timeout_s)
        self._models_task: asyncio.Task | None = None
        self.membership = FleetMembership(
            config.replicas, self.controller, self.health, self._make_source, shared,
            on_join=self._joined, on_leave=self.models.remove, on_forget=self._forgotten)
        self.status = ProxyStatus(config, self.controller, self.health, self.models,
                                  self.transport, self.urls, self.routable, sources, self.membership)
        self.watcher: ReplicaWatcher | None = None
        if proxy.replicas_from is not None:  # the fleet is listed there, re-read while running
            self.watcher = ReplicaWatcher(
                replica_source(proxy.replicas_from, state_source),
                proxy.replicas_from_interval_s, self.apply_replicas, config.replicas,
                tick=self.forget_drained)

    # --- fleet membership (replicas_from: guard.replicas.membership) -------------------------
    @property
    def replicas(self) -> dict[str, ReplicaConfig]:
        return self.membership.replicas

    @property
    def leaving(self) -> dict[str, ReplicaConfig]:
        return self.membership.leaving

    def apply_replicas(self, replicas: tuple[ReplicaConfig, ...]) -> None:
        """The fleet is now ``replicas`` (:meth:`FleetMembership.apply`)."""
        self.membership.apply(replicas)

    def forget_drained(self) -> None:
        self.membership.forget_drained()

    def _make_source(self, replica: ReplicaConfig) -> Any:
        source, = state_sources((replica,), self._state_client,
                                timeout_s=self.config.state_timeout_s,
                                stream_interval_s=self.config.refresh_interval_s,
                                first_index=next(self._next_phase_index)).values()
        if self.shards is not None:
            source = self._shared(replica.url, source)
        self._sources[replica.replica_id] = source
        return source

    def _shared(self, url: str, source: Any) -> SharedStateSource:
        assert self.shards is not None
        return SharedStateSource(source, url, self.shards, clock=self.clock)

    def _joined(self, replica: ReplicaConfig) -> None:
        rid = replica.replica_id
        self.urls[rid] = replica.url
        self.forwarder.set_replica(rid, replica.url, replica.api_key)
        self.models.add(replica)
        self.metrics.add(rid)

    def _forgotten(self, rid: str) -> None:
        self.forwarder.drop(rid)
        self.urls.pop(rid, None)
        self._sources.pop(rid, None)
        self.metrics.remove(rid)

    # --- routing facts ------------------------------------------------------------------------
    def routable(self, replica_id: str) -> bool:
        return self.load_state.is_healthy(replica_id) and not self.health.is_ejected(replica_id) \
            and replica_id in self.replicas

    def _relay_replica(self, model: object) -> str | None:
        """For an unpriced relayed request: the routable replica serving ``model`` with the
        fewest requests in flight (None: none routable; PricingError: an unknown model)."""
        allowed = self.models.replicas_for(model)
        candidates = [rid for rid in self.urls if self.routable(rid)
                      and (allowed is None or rid in allowed)]
        return min(candidates, key=self.load_state.num_inflight, default=None)

    def _relay_headers(self, replica_id: str, raw_headers: RawHeaders) -> RawHeaders:
        return self.forwarder.credentialed(
            replica_id, [h for h in raw_headers if h[0] not in self._not_forwarded])

    def _mark_unhealthy(self, replica_id: str) -> None:  # the replica was ejected
        self.load_state.mark_unhealthy(replica_id, self.clock())
        self.metrics.ejected(replica_id)

    async def _probe(self, replica_id: str) -> bool:
        """An ejected replica is back when its ``/health`` answers 2xx, or, where it has no
        ``/health`` (404: llama-cpp-python's server), when its ``/v1/models`` does."""
        url, timeout_s = self.urls[replica_id], self.config.state_timeout_s
        try:
            status, _ = await self.transport.get(url + "/health", timeout_s)
            if status == 404:
                status, _ = await self.transport.get(url + "/v1/models", timeout_s,
                                                     self.models.headers_for(replica_id))
        except UpstreamError:
            return False
        return 200 <= status < 300

    def _redispatch(self, admission: Admitted, failed_replica_id: str) -> str | None:
        """The policy re-decides an admission whose replica failed before answering, among
        the other routable replicas (the controller moves its reservation)."""
        others = [rid for rid in self.urls if rid != failed_replica_id and self.routable(rid)]
        return self.controller.redispatch(admission, others) if others else None

    # --- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "POST":  # priced on the target's decoded path, forwarded as sent
            target = scope_target(scope, self._is_admitted)
            if target.__class__ is not Target:
                return await self._refuse(scope, send, target)
            if target.admitted:
                return await self._admit(scope, receive, send, target)
        if method in ("GET", "POST"):
            route = self.passthrough.route(path)
            if route is not None:
                return await self._relay(scope, receive, send, route)
        if path in _GATED_PATHS and self._access.enabled:
            rejection = self._access.check(path, headers_from_scope(scope))
            if rejection is not None:
                return await send_rejection(send, rejection)
        if method == "GET" and path in PROBE_PATHS:
            return await self.status.probe_answer(send, path)
        if method == "GET" and path == MODELS_PATH:
            return await self.status.models_answer(send)
        if method == "GET" and path == "/kvguard/state":
            return await send_json(send, 200, self.state())
        if method == "GET" and path in (GUARD_METRICS_PATH, "/metrics"):
            return await self.controller.metrics.send_response(send)
        await send_json(send, 404, {"error": {"message": f"no route {method} {path}",
                                               "type": "invalid_request_error",
                                               "param": None, "code": "not_found"}})

    async def _relay(self, scope: dict, receive: Receive, send: Send, route: str) -> None:
        """A ``relayed_paths`` request: unpriced, to one replica (gated like ``/v1/models``)."""
        headers = headers_from_scope(scope)
        if self._access.enabled:
            rejection = self._access.check(MODELS_PATH, headers)
            if rejection is not None:
                return await send_rejection(send, rejection)
        body = b""
        if scope["method"] == "POST":
            try:
                body = await read_body(receive, self.config.max_body_bytes,
                                       content_length(headers))
            except BodyTooLarge as error:
                return await send_rejection(send, Rejection(413, error.reason, error.message))
            except ClientDisconnected:
                return None
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        await self.passthrough.relay(route, scope["method"], scope["path"],
                                     target.decode("latin-1"), scope["headers"], body, send)

    async def _refuse(self, scope: dict, send: Send, error: PricingError) -> None:
        """A request refused before its body is read (a target the guard will not forward):
        answered and counted by the controller like any other rejection (a 401 first)."""
        headers = headers_from_scope(scope)
        request = AdmissionRequest(scope["path"], headers, b"", None, error)
        result = self.controller.decide(request)
        if isinstance(result, Wait):
            result = await self.controller.wait(result)
        await send_rejection(send, result, self.responder.rejection_headers(
            result, headers.get("authorization"), client_request_id(headers.get("x-request-id"))))

    async def _admit(self, scope: dict, receive: Receive, send: Send, target: Target) -> None:
        """Admission by the controller, then the forwarder; bad input never leaves here."""
        headers = headers_from_scope(scope)
        exchange = AsgiExchange(receive, self.config.max_body_bytes, content_length(headers),
                             scope.get("extensions"))
        try:
            request = await read_request(target.path, headers, exchange.read_body,
                                         exchange.client_gone)
            result = self.controller.decide(request)
            if isinstance(result, Wait):
                result = await self.controller.wait(result)
            await self.responder.answer(
                result, target.raw, scope["headers"], exchange.client_gone, send,
                exchange.writer, client_request_id(headers.get("x-request-id")),
                headers.get("authorization"))
        finally:
            exchange.stop()

    # --- kvguard's own server: the request decided and sent from its read callback ----------
    def http_direct(self, request: RequestHead, exchange: Exchange) -> Coroutine | bool | None:
        """kvguard's server offers each request whose head and body are in here first
        (:class:`guard.proxy.direct.DirectPath`): None sends it down the ASGI path."""
        return self._direct.http_direct(request, exchange)

    # --- status ---------------------------------------------------------------------------------
    def not_ready_reason(self) -> str | None:
        """Why the proxy should get no traffic now (None: ready)."""
        return self.status.not_ready_reason()

    def state(self) -> dict:
        """``GET /kvguard/state``: the proxy's view of each replica."""
        return self.status.state(self.num_in_flight)

    # --- lifecycle ----------------------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        """The replicas' model lists and first state poll, then the poller, the queue pump,
        the probes and the model lists' refresh."""
        config = self.config
        await self.models.refresh(self.transport.get, config.state_timeout_s)
        await start_fleet(self.controller, self.health, self.shards, self.watcher)
        if (self.models.polled_urls or self.watcher is not None) and self._models_task is None:
            self._models_task = asyncio.ensure_future(self.models.run(
                self.transport.get, config.refresh_interval_s, config.state_timeout_s,
                busy=self.load_state.num_inflight,  # a read can cut a stream: see the module
                state_model=self.load_state.served_model))  # a list it lacks: read it soon

    def drain(self) -> None:
        """Stop admitting (new and queued requests: 503 ``shutting_down``, ``/health`` 503);
        admitted requests run on."""
        if not self.controller.draining:
            _log.info("draining: no new requests admitted; %d in flight finish within %g s",
                      self.num_in_flight, self.config.proxy.drain_timeout_s)
        self.controller.begin_drain()

    @property
    def num_in_flight(self) -> int:
        return self.controller.tickets.num_held

    async def aclose(self) -> None:
        if self._models_task is not None:
            self._models_task.cancel()
            await asyncio.gather(self._models_task, return_exceptions=True)
            self._models_task = None
        await stop_fleet(self.controller, self.health, self.shards, self.watcher)
        await self.transport.aclose()
