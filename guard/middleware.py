"""``AdmissionMiddleware``: the guard as pure ASGI middleware in front of any ASGI app.

A thin adapter over :class:`guard.controller.AdmissionController` (the whole admission flow
lives there). ``POST`` requests whose path matches ``admitted_paths`` (default: any path
ending in ``/v1/completions`` or ``/v1/chat/completions``, so router prefixes are covered) are
admitted; everything else (``/health``, ``/v1/models``, ``/kvguard/state``, ``/metrics``) passes
straight through. The guard's own Prometheus metrics are served at ``/kvguard/metrics``;
``/metrics`` goes to the wrapped app first (an engine serves its vLLM-named metrics there) and
the guard answers it only when the wrapped app says 404.

The wrapped app is the one replica, ``local``, whose ``/kvguard/state`` is polled through the
app itself (started on the first admitted request). An app without
``/kvguard/state`` (404 or not JSON) becomes a healthy replica of unknown capacity: the ``slo``
policy then admits ``unknown_capacity_max_inflight`` requests at a time. ``[[replicas]]`` are
the standalone proxy's: configured here they are refused at construction.

Configuration is read and validated in ``__init__`` (no-argument construction reads
``KVGUARD_CONFIG`` / ``KVGUARD_*``), so a bad key stops a server at start-up whether or not it
runs the ASGI lifespan. A disconnect reaches the wrapped app as ``http.disconnect``, which is
how an in-process engine learns to abort the sequence.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from guard.admission import Admission
from guard.body import content_length, headers_from_scope
from guard.config import GuardConfig, load_config
from guard.controller import AdmissionController
from guard.pricing import Pricer
from guard.relay import Relay
from guard.replicas.load_state import LoadState
from guard.replicas.poller import AsgiStateSource
from guard.shedding import send_rejection
from guard.trace import TraceWriter

__all__ = ["AdmissionMiddleware", "GUARD_METRICS_PATH", "LOCAL_REPLICA"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GUARD_METRICS_PATH = "/kvguard/metrics"
LOCAL_REPLICA = "local"


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

    # --- dispatch by scope ----------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if scope["method"] == "POST" and self._is_admitted(path):
                return await self._admit(scope, receive, send)
            if path == GUARD_METRICS_PATH:
                return await self.controller.metrics.send_response(send)
            if path == "/metrics":
                return await self._metrics_fallback(scope, receive, send)
        elif kind == "lifespan":
            return await self.app(scope, self._lifespan_receive(receive), send)
        await self.app(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = headers_from_scope(scope)
        state = Relay(receive, send, self._max_body_bytes, content_length(headers))
        result = await self.controller.admit(scope["path"], headers, state.read_body,
                                             state.client_gone)
        if isinstance(result, Admission):
            return await state.run(self.app, scope, result)
        state.stop_watching()
        if result is not None:
            await send_rejection(send, result)

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message
        return wrapped

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
