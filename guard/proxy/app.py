"""``ProxyApp``: the standalone proxy as one ASGI app in front of N replicas over HTTP.

Routes:

* ``POST`` to an admitted path (``admitted_paths``; by default any path ending in
  ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/embeddings``): admission (tenant → price → policy →
  admit | queue | shed) and, once admitted, :class:`guard.proxy.upstream.Forwarder` relays the
  request to the replica the policy picked (``Admit(replica_id)``: for ``slo`` the lowest
  predicted TTFT where the request fits, least-loaded for the baselines). Bad input is answered
  here and never reaches a replica.
* ``GET /v1/models``: the union of the routable replicas' model lists.
* Routing by model: a request is decided only among the replicas serving its ``model``
  (:class:`guard.proxy.model_catalog.ModelCatalog`: ``[[replicas]] models`` or each replica's
  ``/v1/models``); a model none serves is a 404 ``model_not_found`` that reaches no replica.
* ``GET /livez``: 200 while the process serves (liveness). ``GET /readyz`` (and ``/health``,
  kept for compatibility): 200 while a replica is routable and the proxy is not draining,
  else 503 with the reason (readiness: take it out of rotation, do not restart it).
* ``GET /kvguard/state``: the proxy's view of every replica (health, state age, reserved blocks,
  in-flight requests).
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
adapter, beside the middleware). The operational endpoints are gated like the middleware's
(:class:`guard.operational_access.OperationalAccess`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.rate_limit_headers import rate_limit_headers
from guard.admission.request import AdmissionRequest, read_request
from guard.admission.shedding import Rejection, send_rejection
from guard.admission.wait import Wait
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.errors import BodyTooLarge, ClientDisconnected, PricingError
from guard.observe.access_log import with_access_log
from guard.operational_access import ADMIN_PATHS, MODELS_PATH, OperationalAccess
from guard.proxy.h1_message import NOT_FORWARDED
from guard.proxy.health import ReplicaHealth
from guard.proxy.metrics import ProxyMetrics
from guard.proxy.model_catalog import ModelCatalog
from guard.proxy.passthrough import Passthrough
from guard.proxy.state_client import TransportStateClient
from guard.proxy.transports import Transport, UpstreamError, make_transport
from guard.proxy.upstream import BodyWriter, Forwarder
from guard.redact import redact_url
from guard.relay import REQUEST_ID_HEADER
from guard.replicas.poller import state_sources
from guard.replicas.shared_reservations import SharedReservations
from guard.request.body import content_length, headers_from_pairs, headers_from_scope, read_body
from guard.request.request_ids import client_request_id, id_headers
from guard.request.target import Target, read_target, scope_target

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
LIVEZ_PATH, READYZ_PATH = "/livez", "/readyz"  # Kubernetes' liveness and readiness probes
PROBE_PATHS = frozenset({LIVEZ_PATH, READYZ_PATH, "/health"})  # /health: /readyz's answer
SHARED_LEASE_MIN_S = 2.0  # a published reservation outlives its guard this long at least,
SHARED_LEASE_REFRESHES = 10  # and this many state refreshes (renewed every refresh)
_GATED_PATHS = ADMIN_PATHS | {MODELS_PATH}


class ProxyApp:
    """ASGI app of ``kvguard proxy``. ``transport``, ``registry`` and ``budget`` (a budget
    store; None: the controller builds what the config asks for) may be injected;
    ``access_log``: one ``kvguard.access`` line per request (:mod:`guard.observe.access_log`)."""

    def __init__(self, config: GuardConfig, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] | None = None, transport: Transport | None = None,
                 budget: Any = None, access_log: bool = False) -> None:
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
        sources = state_sources(config.replicas, TransportStateClient(self.transport),
                                timeout_s=config.state_timeout_s)
        self._sources = sources  # what each replica's state source found (``auto``)
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
        self._budgeted = config.budgets_enabled  # x-ratelimit-* headers for budgeted tenants
        self._is_admitted = config.is_admitted_path
        self.models = ModelCatalog(config.replicas)  # a request routes among its model's
        self.controller.replicas_for = self.models.replicas_for
        self.controller.replica_limits.model_context = self.models.max_model_len
        self.passthrough = Passthrough(proxy.relayed_paths, self.transport, self.urls,
                                       self._relay_replica, self._relay_headers,
                                       self.controller.registry, proxy.read_timeout_s)
        self._models_task: asyncio.Task | None = None

    # --- routing facts ------------------------------------------------------------------------
    def routable(self, replica_id: str) -> bool:
        return self.load_state.is_healthy(replica_id) and not self.health.is_ejected(replica_id)

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
        try:
            status, _ = await self.transport.get(self.urls[replica_id] + "/health",
                                                 self.config.state_timeout_s)
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
            return await self._probe_answer(send, path)
        if method == "GET" and path == MODELS_PATH:
            return await self._models(send)
        if method == "GET" and path == "/kvguard/state":
            return await _send_json(send, 200, self.state())
        if method == "GET" and path in (GUARD_METRICS_PATH, "/metrics"):
            return await self.controller.metrics.send_response(send)
        await _send_json(send, 404, {"error": {"message": f"no route {method} {path}",
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

    async def _probe_answer(self, send: Send, path: str) -> None:
        """``/livez``: the process serves. ``/readyz`` and ``/health``: not draining and a
        replica routable; else 503 with the reason."""
        if path == LIVEZ_PATH:
            return await _send_json(send, 200, {"ok": True})
        reason = self.not_ready_reason()
        body = {"ok": reason is None, "draining": self.controller.draining}
        if reason is not None:
            body["reason"] = reason
        await _send_json(send, 200 if reason is None else 503, body)

    def not_ready_reason(self) -> str | None:
        """Why the proxy should get no traffic now (None: ready)."""
        if self.controller.draining:
            return "shutting down: draining admitted requests"
        if any(self.routable(rid) for rid in self.urls):
            return None
        return "no routable replica: " + "; ".join(
            f"{rid}: {self._why_not_routable(rid)}" for rid in self.urls)

    def _why_not_routable(self, replica_id: str) -> str:
        if self.health.is_ejected(replica_id):
            return "ejected after failing requests"
        error = self.controller.state_error(replica_id)
        return f"state unreadable ({error})" if error else "unhealthy"

    async def _refuse(self, scope: dict, send: Send, error: PricingError) -> None:
        """A request refused before its body is read (a target the guard will not forward):
        answered and counted by the controller like any other rejection (a 401 first)."""
        headers = headers_from_scope(scope)
        request = AdmissionRequest(scope["path"], headers, b"", None, error)
        result = self.controller.decide(request)
        if isinstance(result, Wait):
            result = await self.controller.wait(result)
        await send_rejection(send, result, self._rejection_headers(
            result, headers.get("authorization"), client_request_id(headers.get("x-request-id"))))

    async def _admit(self, scope: dict, receive: Receive, send: Send, target: Target) -> None:
        """Admission by the controller, then the forwarder; bad input never leaves here."""
        headers = headers_from_scope(scope)
        exchange = _Exchange(receive, self.config.max_body_bytes, content_length(headers),
                             scope.get("extensions"))
        try:
            request = await read_request(target.path, headers, exchange.read_body,
                                         exchange.client_gone)
            result = self.controller.decide(request)
            if isinstance(result, Wait):
                result = await self.controller.wait(result)
            await self._answer(result, target.raw, scope["headers"], exchange.client_gone, send,
                               exchange.writer, client_request_id(headers.get("x-request-id")),
                               headers.get("authorization"))
        finally:
            exchange.stop()

    async def _answer(self, result: Admitted | Rejection | None, raw_target: str,
                      raw_headers: RawHeaders, client_gone: Callable[[], asyncio.Future],
                      send: Send, writer: BodyWriter | None, client_id: str | None,
                      authorization: str | None) -> None:
        """The controller's result answered: relayed from the replica (to ``raw_target``, the
        client's target as sent), or the rejection; either echoes ``client_id`` (the client's
        sane ``x-request-id``) or the guard's id."""
        if isinstance(result, Admitted):
            self._annotate(result, client_id)
            return await self.forwarder.forward(
                result, raw_target,
                _upstream_headers(raw_headers, result.request_id, self._not_forwarded),
                client_gone(), send, writer)
        if result is not None:
            await send_rejection(send, result,
                                 self._rejection_headers(result, authorization, client_id))

    # --- kvguard's own server: the request decided and sent from its read callback ----------
    def http_direct(self, request: RequestHead, exchange: Exchange) -> Coroutine | bool | None:
        """kvguard's server calls this for every request whose head and body are in, from the
        read callback (``serving.h1_connection``), before any ASGI scope or task exists.
        An admitted ``POST`` with a ``content-length`` body is decided right here
        (:meth:`~guard.controller.AdmissionController.decide`) and, admitted, written to its
        replica on an idle pooled connection (``h1`` client) before this returns; what is left
        (the relay, or the wait and then the relay when the decision must wait) is the
        coroutine returned, which the server runs as the request's task. A rejection decided
        here is written here (True: answered, no task at all). Everything else (other routes,
        chunked or oversized bodies) gets None: the server serves it through ASGI
        (:meth:`__call__`), as any other server would."""
        if request.method != "POST" or request.chunked:
            return None
        target = read_target(request.raw_path, request.query_string, self._is_admitted)
        if target.__class__ is not Target or not target.admitted:
            return None  # ASGI answers it (a refused target included)
        if (request.content_length or 0) > self.config.max_body_bytes:
            return None  # the ASGI path answers 413
        body = exchange.take_body()
        if body is None:
            return None
        raw_target, raw_headers, gone = target.raw, request.headers, exchange.gone
        headers = headers_from_pairs(raw_headers)
        if b"authorization" in self._not_forwarded:
            raw_headers = [h for h in raw_headers if h[0] != b"authorization"]
        client_id = client_request_id(headers.get("x-request-id"))
        result = self.controller.decide(   # priced on the decoded path, sent as the client sent it
            AdmissionRequest(target.path, headers, body, gone))
        writer = (exchange.write_body, exchange.conn.drain)
        if isinstance(result, Admitted):
            self._annotate(result, client_id)
            try:  # written upstream now, before this returns
                sent = self.forwarder.send_now(result.replica_id, raw_target, raw_headers,
                                               result.body, result.request_id)
            except BaseException as exc:
                result.finish(exc)
                raise
            return self.forwarder.forward(
                result, raw_target,
                _upstream_headers(raw_headers, result.request_id, self._not_forwarded),
                gone(), exchange.send, writer, sent)
        if isinstance(result, Rejection):
            response_headers, response_body = result.response()
            response_headers += self._rejection_headers(result, headers.get("authorization"),
                                                        client_id)
            exchange.respond(result.status, response_headers, response_body)
            return True
        return self._answer_later(result, raw_target, raw_headers, gone, exchange.send, writer,
                                  client_id, headers.get("authorization"))

    async def _answer_later(self, waiting: Wait, raw_target: str, raw_headers: RawHeaders,
                            client_gone: Callable[[], asyncio.Future], send: Send,
                            writer: BodyWriter, client_id: str | None,
                            authorization: str | None) -> None:
        result = await self.controller.wait(waiting)
        await self._answer(result, raw_target, raw_headers, client_gone, send, writer, client_id,
                           authorization)

    # --- what every response says about its request --------------------------------------------
    def _annotate(self, admitted: Admitted, client_id: str | None) -> None:
        """An admitted request's response: the client's id echoed, its tenant's rate limits
        and what is left of them (when the budget store knows)."""
        admitted.client_request_id = client_id
        if self._budgeted:
            tenant = admitted.ticket.cost.tenant
            limits = self.config.budget_limits(tenant)
            grants = self.controller.grants
            remaining = getattr(grants.store, "remaining_now", None) if grants is not None else None
            admitted.response_headers = rate_limit_headers(
                limits, remaining=None if remaining is None else remaining(tenant))

    def _rejection_headers(self, rejection: Rejection, authorization: str | None,
                           client_id: str | None) -> RawHeaders:
        """A rejection's ids and, for a budgeted tenant, its rate limits (on a budget 429:
        the axis that said no, and when it has room again)."""
        headers = id_headers(client_id, rejection.request_id)
        if self._budgeted:
            tenant = self.controller.tenant(authorization)
            if tenant is not None:
                limits = self.config.budget_limits(tenant.name)
                if rejection.status == 429:
                    headers += rate_limit_headers(limits, rejection.reason,
                                                  rejection.retry_after_s)
                else:
                    headers += rate_limit_headers(limits)
        return headers

    async def _models(self, send: Send) -> None:
        routable = [rid for rid in self.urls if self.routable(rid)]
        answers = await asyncio.gather(*(self.transport.get(
            self.urls[rid] + "/v1/models", self.config.state_timeout_s,
            self.models.headers_for(rid)) for rid in routable),
            return_exceptions=True)
        models: dict[str, dict] = {}
        for answer in answers:
            if isinstance(answer, tuple) and answer[0] == 200:
                try:
                    for model in json.loads(answer[1]).get("data", ()):
                        models.setdefault(model["id"], model)
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
        if not models and routable:
            return await send_rejection(send, Rejection(502, "upstream_failed",
                                                        "no replica listed its models",
                                                        should_retry=True))
        await _send_json(send, 200, {"object": "list", "data": list(models.values())})

    def state(self) -> dict:
        """``GET /kvguard/state``: the proxy's view of each replica."""
        now_s = self.clock()
        replicas = []
        for replica in self.config.replicas:
            rid = replica.replica_id
            snap = self.load_state.replica_snapshot(rid)
            replicas.append({
                "replica_id": rid, "url": redact_url(replica.url), "state_source": replica.state_source,
                "weight": replica.weight, "has_api_key": replica.api_key is not None,
                "routable": self.routable(rid), "healthy": self.load_state.is_healthy(rid),
                "ejected": self.health.is_ejected(rid),
                "consecutive_failures": self.health.consecutive_failures(rid),
                "state_error": self.controller.state_error(rid),
                "models": sorted(self.models.models_of(rid) or ()) or None,
                "state_age_s": None if snap is None else round(now_s - snap.observed_s, 4),
                "capacity_known": None if snap is None else snap.capacity_known,
                "num_total_blocks": None if snap is None else snap.num_total_blocks,
                "num_free_blocks": None if snap is None else snap.num_free_blocks,
                "num_reserved_blocks": self.load_state.num_reserved_blocks(rid),
                "num_inflight": self.load_state.num_inflight(rid),
                "concurrency_limit": None if snap is None else snap.concurrency_limit,
                **_source_choice(self._sources.get(rid)),
            })
        return {"admitting": not self.controller.draining, "policy": self.config.policy,
                "num_in_flight": self.num_in_flight, "num_queued": len(self.controller.queue),
                "replicas": replicas}

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
        await self.controller.start()
        self.health.start()
        if self.models.polled_urls and self._models_task is None:
            self._models_task = asyncio.ensure_future(self.models.run(
                self.transport.get, config.refresh_interval_s, config.state_timeout_s))

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
        await self.health.stop()
        await self.controller.aclose()
        self.controller.close()
        await self.transport.aclose()


def _upstream_headers(raw_headers: RawHeaders, request_id: str,
                      not_forwarded: frozenset[bytes] = NOT_FORWARDED) -> RawHeaders:
    """The client's end-to-end headers (less ``not_forwarded``) with the guard's
    ``x-request-id`` (the body may have been rewritten, so its length is the transport's to
    set)."""
    headers = []
    for name, value in raw_headers:
        if name not in not_forwarded:
            headers.append((name, value))
    headers.append((REQUEST_ID_HEADER, request_id.encode()))
    return headers


class _Exchange:
    """One request's body reader and disconnect watch (what its AdmissionRequest is made of)."""

    __slots__ = ("_receive", "_max_bytes", "_content_length", "gone", "_server_gone", "writer",
                 "_take_body")

    def __init__(self, receive: Receive, max_bytes: int, declared: int | None,
                 extensions: dict | None = None) -> None:
        self._receive = receive
        self._max_bytes = max_bytes
        self._content_length = declared
        self.gone: asyncio.Future | None = None
        # kvguard's server says when the client left (serving.h1_exchange): no task per request
        watch = extensions.get("kvguard.disconnect") if extensions else None
        self._server_gone = watch["future"] if watch else None
        body = extensions.get("kvguard.body") if extensions else None
        self.writer = (body["write"], body["drain"]) if body else None  # chunks without a task
        self._take_body = body.get("take") if body else None  # the body, when all arrived

    def read_body(self) -> bytes | Awaitable[bytes]:
        """The body itself when the server already holds all of it; else an awaitable of it,
        read under the byte limit."""
        take, limit = self._take_body, self._max_bytes
        if take is not None and (self._content_length or 0) <= limit:
            body = take()
            if body is not None:
                if len(body) > limit:  # chunked: no length declared
                    raise BodyTooLarge(limit)
                return body
        return read_body(self._receive, limit, self._content_length)

    def client_gone(self) -> asyncio.Future:
        """Completes with the client's ``http.disconnect`` (made on first use)."""
        if self.gone is None:
            if self._server_gone is not None:
                self.gone = self._server_gone()
            else:
                self.gone = asyncio.ensure_future(_until_disconnect(self._receive))
        return self.gone

    def stop(self) -> None:
        if self.gone is not None and not self.gone.done() and self._server_gone is None:
            self.gone.cancel()  # the watch task (the server's future is the server's)


async def _until_disconnect(receive: Receive) -> Message:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return message


async def _send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _source_choice(source: Any) -> dict:
    """What an ``auto`` state source chose for the replica, and why (nothing for the others)."""
    if not hasattr(source, "choice"):
        return {}
    return {"state_source_chosen": source.choice, "state_source_reason": source.reason}
