"""``AdmissionMiddleware``: the guard as pure ASGI middleware in front of any ASGI app.

A thin adapter over :class:`guard.controller.AdmissionController` (the whole admission flow
lives there). ``POST`` requests whose path matches ``admitted_paths`` (default: any path
ending in ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or
``/v1/embeddings``, so router prefixes are covered) are
admitted; everything else (``/health``, ``/v1/models``, ``/kvguard/state``, ``/metrics``) passes
straight through, behind :class:`~guard.operational_access.OperationalAccess` when it is on
(the admin key for ``/kvguard/*`` and ``/metrics``, a known key for ``/v1/models``; on by
default when anonymous requests are refused). The guard's own Prometheus metrics are served at
``/kvguard/metrics``;
``/metrics`` goes to the wrapped app first (an engine serves its vLLM-named metrics there) and
the guard answers it only when the wrapped app says 404. A ``POST`` is priced on its target's
decoded path, the one the wrapped app routes on; a target that could be read as an admitted
path in more than one way is refused 400 (:mod:`guard.request.target`).

The wrapped app is the one replica, ``local``, whose ``/kvguard/state`` is polled through the
app itself (started on the first admitted request; a budget store's Redis link opens earlier,
at lifespan startup, when the server runs the lifespan). An app without
``/kvguard/state`` (404 or not JSON) becomes a healthy replica of unknown capacity: the ``slo``
policy then admits ``policy_params.stale_max_inflight_per_replica`` requests at a time.
``[[replicas]]`` are the standalone proxy's: configured here they are refused at construction.

Configuration is read and validated in ``__init__`` (no-argument construction reads
``KVGUARD_CONFIG`` / ``KVGUARD_*``), so a bad key stops a server at start-up whether or not it
runs the ASGI lifespan. A disconnect reaches the wrapped app as ``http.disconnect``, which is
how an in-process engine learns to abort the sequence. :meth:`AdmissionMiddleware.drain` stops
admitting first on shutdown; it registers itself with a server's ``serving.drain_hooks``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest, read_request
from guard.admission.shedding import send_rejection
from guard.admission.wait import Wait
from guard.config import GuardConfig, load_config
from guard.controller import AdmissionController
from guard.errors import PricingError
from guard.observe.trace import TraceWriter
from guard.operational_access import ADMIN_PATHS, MODELS_PATH, OperationalAccess
from guard.relay import Relay
from guard.replicas.load_state import LoadState
from guard.replicas.poller import AsgiStateSource
from guard.request.body import content_length, headers_from_scope
from guard.request.pricing import Pricer
from guard.request.request_ids import client_request_id, id_headers
from guard.request.target import Target, scope_target
from guard.state_page import STATE_PATH, not_admitting
from serving.drain_hooks import register_drain_hook

__all__ = ["AdmissionMiddleware", "GUARD_METRICS_PATH", "LOCAL_REPLICA"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GUARD_METRICS_PATH = "/kvguard/metrics"
LOCAL_REPLICA = "local"
_GATED_PATHS = ADMIN_PATHS | {MODELS_PATH}


class AdmissionMiddleware:
    """Pure ASGI admission control over the wrapped app. See the module docstring.

    Collaborators may be injected (tests, the bench): ``policy``, ``load_state`` (then no poller
    runs unless ``poll_state=True``), ``pricer``, ``rng``, ``trace``, ``tokenizer``, ``budget``;
    they are handed to the :attr:`controller`.
    """

    def __init__(self, app: Callable, config: GuardConfig | None = None, *,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] | None = None,
                 tokenizer: Callable[[str], int] | None = None, policy: Any = None,
                 load_state: LoadState | None = None, pricer: Pricer | None = None,
                 rng: random.Random | None = None, trace: TraceWriter | None = None,
                 poll_state: bool | None = None, budget: Any = None) -> None:
        config = config if config is not None else load_config()
        if config.replicas:
            raise ValueError("replicas: [[replicas]] (or KVGUARD_UPSTREAMS) are for the "
                             "standalone proxy; the middleware's replica is the app it wraps")
        self.app = app
        self.config = config
        poll = load_state is None if poll_state is None else poll_state
        sources = {LOCAL_REPLICA: AsgiStateSource(app)} if poll else None
        self.controller = AdmissionController(
            config, sources, registry=registry, clock=clock, tokenizer=tokenizer, policy=policy,
            load_state=load_state, pricer=pricer, rng=rng, trace=trace, budget=budget)
        self._max_body_bytes = config.max_body_bytes
        self._is_admitted = config.is_admitted_path
        self._access = OperationalAccess(config)
        self._drain_hook_set = False  # registered with the server's drain hooks

    # --- dispatch by scope ----------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if not self._drain_hook_set and "state" in scope:  # the hooks live in the state
                self._drain_hook_set = register_drain_hook(scope, self.drain)
            if scope["method"] == "POST":  # priced on the decoded target the app routes on
                target = scope_target(scope, self._is_admitted)
                if target.__class__ is not Target:
                    return await self._refuse(scope, send, target)
                if target.admitted:
                    return await self._admit(scope, receive, send, target.path)
            if path in _GATED_PATHS and self._access.enabled:
                rejection = self._access.check(path, headers_from_scope(scope))
                if rejection is not None:
                    return await send_rejection(send, rejection)
            if path == "/health" and self.controller.draining:
                return await _send_json(send, 503, {"ok": False, "draining": True})
            if path == STATE_PATH and self.controller.draining:
                return await self.app(scope, receive, not_admitting(send))
            if path == GUARD_METRICS_PATH:
                return await self.controller.metrics.send_response(send)
            if path == "/metrics":
                return await self._metrics_fallback(scope, receive, send)
        elif kind == "lifespan":
            self._drain_hook_set = register_drain_hook(scope, self.drain)
            return await self.app(scope, self._lifespan_receive(receive), send)
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, error: PricingError) -> None:
        """A request refused before its body is read (a target the guard will not forward):
        answered and counted by the controller like any other rejection (a 401 first)."""
        headers = headers_from_scope(scope)
        request = AdmissionRequest(scope["path"], headers, b"", None, error)
        result = self.controller.decide(request)
        if isinstance(result, Wait):
            result = await self.controller.wait(result)
        await send_rejection(send, result, id_headers(
            client_request_id(headers.get("x-request-id")), result.request_id))

    async def _admit(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        headers = headers_from_scope(scope)
        relay = Relay(receive, send, self._max_body_bytes, content_length(headers))
        request = await read_request(path, headers, relay.read_body, relay.client_gone)
        result = self.controller.decide(request)
        if isinstance(result, Wait):
            result = await self.controller.wait(result)
        client_id = client_request_id(headers.get("x-request-id"))
        if isinstance(result, Admitted):
            result.client_request_id = client_id
            return await relay.run(self.app, scope, result)
        relay.stop_watching()
        if result is not None:
            await send_rejection(send, result, id_headers(client_id, result.request_id))

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":  # budgets' Redis link: now, not on the
                await self.controller.open_budget()     # first request (bounded wait)
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message
        return wrapped

    async def drain(self) -> None:
        """Stop admitting (503 ``shutting_down``, ``/health`` 503) and return once every
        admitted request has ended. A server that publishes drain hooks
        (``serving.drain_hooks``, as ``kvguard engine`` does) calls it on SIGTERM before it
        drains itself; any other server may call it from its own shutdown."""
        self.controller.begin_drain()
        await self.controller.wait_drained()

    async def aclose(self) -> None:
        """Stop the controller's background work and flush the trace. Safe to call twice."""
        await self.controller.aclose()

    def close(self) -> None:
        """Final: flush and close the trace file."""
        self.controller.close()

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
            await self.controller.metrics.send_response(send)


async def _send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
