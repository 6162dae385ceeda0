"""``ProxyApp``: the standalone proxy as one ASGI app in front of N replicas over HTTP.

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: admission (tenant → price → policy →
  admit | queue | shed) and, once admitted, :class:`guard.proxy.upstream.Forwarder` relays the
  request to the replica the policy picked (``Admit(replica_id)``: for ``slo`` the lowest
  predicted TTFT where the request fits, least-loaded for the baselines). Bad input is answered
  here and never reaches a replica.
* ``GET /v1/models``: the union of the routable replicas' model lists.
* ``GET /health``: 200 while at least one replica is routable (and the proxy is not draining).
* ``GET /kvguard/state``: the proxy's view of every replica (health, state age, reserved blocks,
  in-flight requests).
* ``GET /kvguard/metrics``: the guard's and the proxy's Prometheus series.

Each replica's load comes from its ``/kvguard/state`` (``state_source = "kvguard"``), its vLLM
``/metrics`` (``"vllm"``) or nowhere (``"none"``: unknown capacity), polled every
``refresh_interval_s``; :class:`guard.proxy.health.ReplicaHealth` ejects replicas that fail
requests and probes them back. ``drain()`` (SIGTERM) stops admitting: new requests get 503
``shutting_down`` while admitted ones finish.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.load_state import LoadState
from guard.middleware import ADMITTED_PATHS, AdmissionMiddleware
from guard.proxy.health import NoStateSource, ReplicaHealth
from guard.proxy.metrics import ProxyMetrics
from guard.proxy.transports import HOP_BY_HOP, Transport, UpstreamError, make_transport
from guard.proxy.upstream import Forwarder
from guard.rejection import Rejection, send_rejection
from guard.state_poller import HttpStateSource, StatePoller, StateSource

__all__ = ["ProxyApp"]

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _Admission(AdmissionMiddleware):
    """The guard's admission flow with the proxy's replicas as its load-state sources."""

    def __init__(self, app: Callable, config: GuardConfig, *, sources: dict[str, StateSource],
                 **kwargs: Any) -> None:
        super().__init__(app, config, poll_state=True, **kwargs)
        self._sources = sources

    def _make_poller(self) -> StatePoller:
        return StatePoller(self.load_state, self._sources, self.config.refresh_interval_s,
                           clock=self.clock, timeout_s=self.config.state_timeout_s,
                           unhealthy_after_errors=self.config.unhealthy_after_errors,
                           on_refresh=self._on_state_refresh)


class ProxyApp:
    """ASGI app of ``kvguard proxy``. ``transport`` and ``registry`` may be injected."""

    def __init__(self, config: GuardConfig, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] | None = None,
                 transport: Transport | None = None) -> None:
        if not config.replicas or any(r.url is None for r in config.replicas):
            raise ValueError("replicas: the proxy needs at least one replica with a url "
                             "(--upstream URL or [[replicas]])")
        self.config = config
        self.clock = clock or time.monotonic
        proxy = config.proxy
        self.urls = {r.replica_id: r.url for r in config.replicas}
        self.load_state = LoadState(config.max_staleness_s)
        self.transport = transport or make_transport(
            proxy.upstream_client, proxy.connect_timeout_s, proxy.read_timeout_s,
            proxy.max_upstream_connections)
        self.health = ReplicaHealth(self.urls, proxy.eject_after_failures, proxy.probe_interval_s,
                                    self._mark_unhealthy, self._probe, self.clock)
        self._state_client = httpx.AsyncClient(trust_env=False)
        self.admission = _Admission(self._inner, config, sources=self._sources(),
                                    registry=registry, clock=self.clock,
                                    load_state=self.load_state)
        self.metrics = ProxyMetrics(self.admission.registry, list(self.urls), self.routable,
                                    self.health.num_ejections.__getitem__)
        self.forwarder = Forwarder(self.urls, self.transport, self.health, self._redispatch,
                                   self.metrics)
        self.draining = False

    def _sources(self) -> dict[str, StateSource]:
        sources: dict[str, StateSource] = {}
        for replica in self.config.replicas:
            if replica.state_source == "none":
                inner: StateSource = NoStateSource()
            else:
                inner = HttpStateSource(replica.url, replica.state_source,
                                        client=self._state_client,
                                        timeout_s=self.config.state_timeout_s,
                                        max_model_len=replica.max_model_len)
            sources[replica.replica_id] = self.health.gate(replica.replica_id, inner)
        return sources

    # --- routing facts ------------------------------------------------------------------------
    def routable(self, replica_id: str) -> bool:
        return self.load_state.is_healthy(replica_id) and not self.health.is_ejected(replica_id)

    def _mark_unhealthy(self, replica_id: str) -> None:
        self.load_state.mark_unhealthy(replica_id, self.clock())

    async def _probe(self, replica_id: str) -> bool:
        try:
            status, _ = await self.transport.get(self.urls[replica_id] + "/health",
                                                 self.config.state_timeout_s)
        except UpstreamError:
            return False
        return 200 <= status < 300

    def _redispatch(self, ticket: Any, failed_replica_id: str) -> str | None:
        """Move an admitted request whose replica failed before answering to the routable
        replica with the fewest of our requests in flight; None when there is none."""
        candidates = [rid for rid in self.urls if rid != failed_replica_id and self.routable(rid)]
        if not candidates:
            return None
        replica_id = min(candidates, key=self.load_state.num_inflight)
        self.load_state.release(ticket.request_id)
        self.load_state.reserve(replica_id, ticket.request_id, ticket.cost, self.clock())
        ticket.replica_id = replica_id
        return replica_id

    # --- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        if self.draining and scope["path"] in ADMITTED_PATHS:
            return await send_rejection(send, Rejection(
                503, "shutting_down", "this kvguard proxy is shutting down", should_retry=True))
        await self.admission(scope, receive, send)

    async def _inner(self, scope: dict, receive: Receive, send: Send) -> None:
        """What the admission flow wraps: forwarding, and the proxy's own GET routes."""
        path, method = scope["path"], scope["method"]
        if path in ADMITTED_PATHS and method == "POST":
            return await self._forward(scope, receive, send)
        if method == "GET" and path == "/health":
            ok = not self.draining and any(self.routable(rid) for rid in self.urls)
            return await _send_json(send, 200 if ok else 503,
                                    {"status": "ok" if ok else "unavailable"})
        if method == "GET" and path == "/v1/models":
            return await self._models(send)
        if method == "GET" and path == "/kvguard/state":
            return await _send_json(send, 200, self.state())
        await _send_json(send, 404, {"error": {"message": f"no route {method} {path}",
                                               "type": "invalid_request_error",
                                               "param": None, "code": "not_found"}})

    async def _forward(self, scope: dict, receive: Receive, send: Send) -> None:
        first = await receive()  # the admission flow replays the body it already read
        headers = [(n, v) for n, v in scope["headers"] if n not in HOP_BY_HOP]
        await self.forwarder.forward(_ticket_of(send), scope["path"], headers,
                                     first.get("body", b""), receive, send)

    async def _models(self, send: Send) -> None:
        routable = [rid for rid in self.urls if self.routable(rid)]
        answers = await asyncio.gather(*(self.transport.get(
            self.urls[rid] + "/v1/models", self.config.state_timeout_s) for rid in routable),
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
                "replica_id": rid, "url": replica.url, "state_source": replica.state_source,
                "routable": self.routable(rid), "healthy": self.load_state.is_healthy(rid),
                "ejected": self.health.is_ejected(rid),
                "consecutive_failures": self.health.consecutive_failures(rid),
                "state_age_s": None if snap is None else round(now_s - snap.observed_s, 4),
                "capacity_known": None if snap is None else snap.capacity_known,
                "num_total_blocks": None if snap is None else snap.num_total_blocks,
                "num_free_blocks": None if snap is None else snap.num_free_blocks,
                "num_reserved_blocks": self.load_state.num_reserved_blocks(rid),
                "num_inflight": self.load_state.num_inflight(rid),
            })
        return {"admitting": not self.draining, "policy": self.config.policy,
                "num_in_flight": self.admission.tickets.num_held,
                "num_queued": len(self.admission.queue), "replicas": replicas}

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
        """First state poll, then the poller, the queue pump and the probes."""
        await self.admission.background.start()
        self.health.start()

    def drain(self) -> None:
        """Stop admitting; admitted requests run on."""
        self.draining = True

    @property
    def num_in_flight(self) -> int:
        return self.admission.tickets.num_held

    async def aclose(self) -> None:
        await self.health.stop()
        await self.admission.aclose()
        self.admission.close()
        await self.transport.aclose()
        await self._state_client.aclose()


def _ticket_of(send: Send) -> Any:
    """The admitted request's ticket: the admission flow hands its relay's bound ``send``."""
    return send.__self__.ticket  # type: ignore[attr-defined]


async def _send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
