"""``ProxyStatus``: what the proxy says about itself and its replicas — the probes
(``/livez``, ``/readyz``, ``/health``), ``GET /kvguard/state`` and ``GET /v1/models``.

* ``/livez``: 200 while the process serves (liveness).
* ``/readyz`` (and ``/health``, kept for compatibility): 200 while a replica is routable and
  the proxy is not draining, else 503 with the reason (readiness: take it out of rotation, do
  not restart it).
* ``/kvguard/state``: each replica's health, state age, capacity, reservations, in-flight
  requests, models, and why its state cannot be read (never a secret: URLs are redacted, keys
  only said to exist).
* ``/v1/models``: the union of the routable replicas' model lists.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from guard.admission.shedding import Rejection, send_rejection
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.proxy.exchange import send_json
from guard.proxy.health import ReplicaHealth
from guard.proxy.model_catalog import ModelCatalog
from guard.proxy.transports import Transport
from guard.redact import redact_url
from guard.replicas.membership import FleetMembership

__all__ = ["LIVEZ_PATH", "PROBE_PATHS", "ProxyStatus", "READYZ_PATH"]

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]

LIVEZ_PATH, READYZ_PATH = "/livez", "/readyz"  # Kubernetes' liveness and readiness probes
PROBE_PATHS = frozenset({LIVEZ_PATH, READYZ_PATH, "/health"})  # /health: /readyz's answer


class ProxyStatus:
    """The status routes of one proxy; ``routable(replica_id)`` says whether requests may go
    there, ``sources`` what each replica's state source found, ``membership`` which replicas
    are in the fleet and which are leaving it."""

    def __init__(self, config: GuardConfig, controller: AdmissionController,
                 health: ReplicaHealth, models: ModelCatalog, transport: Transport,
                 urls: Mapping[str, str], routable: Callable[[str], bool],
                 sources: Mapping[str, Any], membership: FleetMembership) -> None:
        self.config = config
        self.membership = membership
        self.controller = controller
        self.health = health
        self.models = models
        self.transport = transport
        self.urls = urls
        self.routable = routable
        self._sources = sources

    async def probe_answer(self, send: Send, path: str) -> None:
        """``/livez``: the process serves. ``/readyz`` and ``/health``: not draining and a
        replica routable; else 503 with the reason."""
        if path == LIVEZ_PATH:
            return await send_json(send, 200, {"ok": True})
        reason = self.not_ready_reason()
        body = {"ok": reason is None, "draining": self.controller.draining}
        if reason is not None:
            body["reason"] = reason
        await send_json(send, 200 if reason is None else 503, body)

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

    async def models_answer(self, send: Send) -> None:
        """``GET /v1/models``: the union of the routable replicas' lists (502 when none
        answered one)."""
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
        await send_json(send, 200, {"object": "list", "data": list(models.values())})

    def state(self, num_in_flight: int) -> dict:
        """``GET /kvguard/state``: the proxy's view of each replica."""
        controller = self.controller
        load_state = controller.load_state
        now_s = controller.clock()
        replicas = []
        leaving = self.membership.leaving
        for replica in [*self.membership.replicas.values(), *leaving.values()]:
            rid = replica.replica_id
            snap = load_state.replica_snapshot(rid)
            replicas.append({
                "replica_id": rid, "url": redact_url(replica.url), "state_source": replica.state_source,
                "weight": replica.weight, "has_api_key": replica.api_key is not None,
                "routable": self.routable(rid), "healthy": load_state.is_healthy(rid),
                "ejected": self.health.is_ejected(rid),
                "consecutive_failures": self.health.consecutive_failures(rid),
                "state_error": controller.state_error(rid),
                "models": sorted(self.models.models_of(rid) or ()) or None,
                "state_age_s": None if snap is None else round(now_s - snap.observed_s, 4),
                "capacity_known": None if snap is None else snap.capacity_known,
                "num_total_blocks": None if snap is None else snap.num_total_blocks,
                "num_free_blocks": None if snap is None else snap.num_free_blocks,
                "num_reserved_blocks": load_state.num_reserved_blocks(rid),
                "num_inflight": load_state.num_inflight(rid),
                "concurrency_limit": None if snap is None else snap.concurrency_limit,
                "leaving": rid in leaving,
                **_source_choice(self._sources.get(rid)),
                **_stream_counts(self._sources.get(rid)),
                **_shared_polling(self._sources.get(rid)),
            })
        return {"admitting": not controller.draining, "policy": self.config.policy,
                "num_in_flight": num_in_flight, "num_queued": len(controller.queue),
                "replicas": replicas}


def _shared_polling(source: Any) -> dict:
    """Shared polling (``proxy.shared_polling_ttl_s``): which decider read the replica and how
    old its snapshot was when this one read it."""
    if not hasattr(source, "polled_by"):
        return {}
    return {"state_polled_by": source.polled_by,
            "shared_snapshot_age_s": None if source.age_s is None else round(source.age_s, 4)}


def _stream_counts(source: Any) -> dict:
    """A streamed replica's events, resyncs and lost deltas (nothing for the others)."""
    source = getattr(source, "stream", source)  # ``auto``: the stream it chose, if any
    if not hasattr(source, "num_resyncs"):
        return {}
    return {"stream_events": source.num_events, "stream_resyncs": source.num_resyncs,
            "stream_gaps": source.num_gaps}


def _source_choice(source: Any) -> dict:
    """What an ``auto`` state source chose for the replica, and why (nothing for the others)."""
    if not hasattr(source, "choice"):
        return {}
    return {"state_source_chosen": source.choice, "state_source_reason": source.reason}
