"""``EppServer``: ``kvguard epp``'s gRPC server: the ext_proc service, gRPC health, drain.

It serves, on one port:

* ``envoy.service.ext_proc.v3.ExternalProcessor`` (:class:`~guard.epp.processor.ExternalProcessor`
  over an :class:`~guard.epp.picker.EndpointPicker` over an
  :class:`~guard.controller.AdmissionController` for the configured replicas, polled for load
  as ``kvguard proxy`` polls them), for the single-filter config and for the split one (a
  decision stream and an observer stream per request, :mod:`guard.epp.handoff`);
* replica health as the proxy keeps it (:class:`~guard.proxy.health.ReplicaHealth`): state
  polls, and passive ejection after ``proxy.eject_after_failures`` requests Envoy could not
  get answered by the replica (its own 5xx), probed back every ``proxy.probe_interval_s``;
* ``grpc.health.v1.Health`` for the services ``""``, ``liveness``, ``readiness`` and the
  ext_proc service name: all SERVING once the first state poll is done; on drain everything
  but ``liveness`` turns NOT_SERVING.

With ``[proxy] replicas_from`` (``--replicas-from``) the replicas are re-read while it runs,
as the proxy's (:mod:`guard.replicas.membership`): a joining one becomes an endpoint once its
state is read, a leaving one is picked no more and forgotten once its requests ended.

With a ``redis_url`` the controller shares tenant budgets (the config's budget store) and
pending KV reservations with every other EPP or proxy on that Redis, so several EPPs behind
one Envoy run active-active.

Drain (:meth:`EppServer.drain`, SIGTERM in :mod:`guard.epp.cli`): new decisions are 503
``shutting_down`` with retry advice, admitted requests run on (their streams are still
served) until they end or ``proxy.drain_timeout_s`` passes; then the server stops.

Its Prometheus series (the proxy's ``kvguard_*``, and for the split config
``kvguard_epp_awaiting_observer`` and ``kvguard_epp_unobserved_total``) are served over HTTP
when asked (:meth:`EppServer.serve_metrics`, ``--metrics-port``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from guard.config import GuardConfig, ReplicaConfig
from guard.controller import AdmissionController
from guard.epp.handoff import DEFAULT_WAIT_S, Handoffs
from guard.epp.metrics_http import MetricsEndpoint
from guard.epp.picker import EndpointPicker, endpoint_of_url
from guard.epp.processor import ExternalProcessor
from guard.observe.access_log import with_access_log
from guard.proxy.health import ReplicaHealth
from guard.replicas.discovery import ReplicaWatcher, replica_source
from guard.replicas.membership import FleetMembership, start_fleet, stop_fleet
from guard.replicas.poller import state_sources
from guard.replicas.shared_polling import SharedStateSource, shards_for
from guard.replicas.shared_reservations import SharedReservations

__all__ = ["EXT_PROC_SERVICE", "EppServer"]

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
SHARED_LEASE_MIN_S = 2.0  # a published reservation outlives its EPP this long at least,
SHARED_LEASE_REFRESHES = 10  # and this many state refreshes (as the proxy's)


class EppServer:
    """One ``kvguard epp``: build it, ``await start(host, port)`` (returns the port), then
    ``await wait_stopped()``; :meth:`drain` from a signal handler. ``num_fallbacks``: other
    endpoints each route names after the chosen one (see
    :class:`~guard.epp.picker.EndpointPicker`). ``observer_wait_s``: how long an admitted
    request whose response an observer stream reports (the split Envoy config) waits for it
    before its ticket is released unobserved; ``epp_id``: its name for the split config's
    routes when several EPPs share an Envoy (:class:`~guard.epp.handoff.Handoffs`)."""

    def __init__(self, config: GuardConfig, *, clock: Callable[[], float] | None = None,
                 state_source: str = "kvguard", access_log: bool = False,
                 num_fallbacks: int = 0, observer_wait_s: float = DEFAULT_WAIT_S,
                 epp_id: str | None = None) -> None:
        if not config.replicas or any(r.url is None for r in config.replicas):
            raise ValueError("replicas: the endpoint picker needs at least one replica with a "
                             "url (--upstream URL or [[replicas]])")
        endpoints = {r.replica_id: endpoint_of_url(r.url) for r in config.replicas}
        self.config = config
        self.urls = {r.replica_id: r.url for r in config.replicas}
        clock = clock or time.monotonic
        self._client = httpx.AsyncClient(trust_env=False)  # state polls and health probes
        # passive ejection as in the proxy: Envoy's own 5xx for a replica (it could not reach
        # it) count as its failures; an ejected replica is probed back
        proxy = config.proxy
        self.health = ReplicaHealth(self.urls, proxy.eject_after_failures,
                                    proxy.probe_interval_s, self._mark_unhealthy, self._probe,
                                    clock)
        sources = state_sources(config.replicas, self._client, timeout_s=config.state_timeout_s,
                                stream_interval_s=config.refresh_interval_s)
        # the index of the next replica to join, for its state stream's phase (state_sources)
        self._next_phase_index = itertools.count(len(config.replicas))
        self.shards = shards_for(config)  # the EPPs (and proxies) share the fleet's polling
        if self.shards is not None:
            sources = {rid: SharedStateSource(source, self.urls[rid], self.shards, clock=clock)
                       for rid, source in sources.items()}
        self._clock = clock
        self.sources = sources  # each replica's state source (shared polling: its counts)
        gated = {rid: self.health.gate(rid, source) for rid, source in sources.items()}
        shared = None
        if config.redis_url is not None:
            shared = SharedReservations(
                config.redis_url, self.urls,
                timeout_s=config.budget.redis_timeout_s,
                lease_s=max(SHARED_LEASE_MIN_S, SHARED_LEASE_REFRESHES * config.refresh_interval_s),
                sync_interval_s=config.refresh_interval_s)
        self.controller = AdmissionController(config, gated, clock=clock,
                                              shared_reservations=shared)
        if access_log:  # one kvguard.access line per request, as the proxy's --access-log
            self.controller.trace = with_access_log(self.controller.trace)
        self.picker = EndpointPicker(self.controller, endpoints, self.health, num_fallbacks)
        self.membership = FleetMembership(
            config.replicas, self.controller, self.health, self._make_source, shared,
            on_join=self._joined, on_forget=self._forgotten)
        self.watcher: ReplicaWatcher | None = None
        if proxy.replicas_from is not None:  # the fleet is listed there, re-read while running
            self.watcher = ReplicaWatcher(
                replica_source(proxy.replicas_from, state_source),
                proxy.replicas_from_interval_s, self.membership.apply, config.replicas,
                tick=self.membership.forget_drained)
        self.handoffs = Handoffs(observer_wait_s, epp_id=epp_id)
        self.controller.metrics.registry.register(_HandoffCollector(self.handoffs))
        self.processor = ExternalProcessor(self.picker, self.handoffs)
        self.grpc_health = health_aio.HealthServicer()
        self.metrics_endpoint = MetricsEndpoint(self.controller.metrics)
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._draining: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind, poll the replicas once, serve; the bound port (``port`` 0: the OS's pick).
        :meth:`serve_metrics` adds the Prometheus endpoint."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = server.add_insecure_port(address)
        if bound == 0:
            raise ValueError(f"cannot bind {address}")
        self._server = server
        await start_fleet(self.controller, self.health, self.shards, self.watcher)
        await server.start()
        for service in _SERVICES:
            await self.grpc_health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return bound

    def _make_source(self, replica: ReplicaConfig) -> Any:
        source, = state_sources((replica,), self._client, timeout_s=self.config.state_timeout_s,
                                stream_interval_s=self.config.refresh_interval_s,
                                first_index=next(self._next_phase_index)).values()
        if self.shards is not None:
            source = SharedStateSource(source, replica.url, self.shards, clock=self._clock)
        self.sources[replica.replica_id] = source
        return source

    def _joined(self, replica: ReplicaConfig) -> None:
        self.urls[replica.replica_id] = replica.url
        self.picker.add(replica.replica_id, endpoint_of_url(replica.url))

    def _forgotten(self, replica_id: str) -> None:
        self.urls.pop(replica_id, None)
        self.picker.remove(replica_id)

    def _mark_unhealthy(self, replica_id: str) -> None:
        self.controller.load_state.mark_unhealthy(replica_id, self.controller.clock())

    async def _probe(self, replica_id: str) -> bool:
        try:
            response = await self._client.get(self.urls[replica_id] + "/health",
                                               timeout=self.config.state_timeout_s)
        except httpx.HTTPError:
            return False
        return 200 <= response.status_code < 300

    async def serve_metrics(self, host: str, port: int) -> int:
        """``GET /metrics`` over HTTP on ``port`` (0: the OS's pick); the bound port."""
        return await self.metrics_endpoint.start(host, port)

    def drain(self) -> None:
        """Stop deciding (SIGTERM): 503 ``shutting_down`` from now on; the server stops once
        the admitted requests ended or the drain timeout passed. A second call stops it now."""
        if self._draining is not None:
            self._stopped.set()
            return
        self.controller.begin_drain()
        self._draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        for service in _SERVICES:
            if service != "liveness":
                await self.grpc_health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline_s = time.monotonic() + self.config.proxy.drain_timeout_s
        while self.controller.tickets.num_held and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        """Serve until :meth:`drain` finished (or was called twice), then stop and close."""
        await self._stopped.wait()
        await self.aclose()

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
        self.handoffs.close()
        await self.metrics_endpoint.aclose()
        await stop_fleet(self.controller, self.health, self.shards, self.watcher)
        await self._client.aclose()


class _HandoffCollector:
    """The split config's observer hand-offs as Prometheus series: admitted requests waiting
    for their observer stream, and those released because none came (a missing or lost
    observer filter shows here)."""

    def __init__(self, handoffs: Handoffs) -> None:
        self.handoffs = handoffs

    def collect(self):
        yield GaugeMetricFamily("kvguard_epp_awaiting_observer",
                                "Admitted requests waiting for their observer stream",
                                value=len(self.handoffs))
        yield CounterMetricFamily("kvguard_epp_unobserved",
                                  "Admitted requests released because no observer stream "
                                  "claimed them in time", value=self.handoffs.num_unobserved)
