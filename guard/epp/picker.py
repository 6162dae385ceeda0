"""``EndpointPicker``: the EPP's director, the plain calls the ext_proc stream loop makes.

The gRPC side (:mod:`guard.epp.processor`) translates Envoy's messages into calls on one
:class:`PickerExchange` per HTTP request and translates the answers back; nothing here sees
protobuf. Per request::

    exchange = picker.exchange(client_gone)
    exchange.on_request_headers(headers)            # lower-case names, pseudo-headers included
    over_limit = exchange.add_body(chunk)           # each chunk; True once past max_body_bytes
    answer = await exchange.decide(subset)          # Route | Rejection | None (client left)
    added = exchange.on_response_headers(headers)   # headers to add to the response
    exchange.on_response_body(chunk, end)           # each chunk as it goes back to the client
    exchange.close(reset)                           # always, once: the stream ended or reset

The decision is :class:`~guard.controller.AdmissionController`'s (``decide``, then ``wait``
when it must wait): the EPP is the controller's third adapter, beside the middleware and the
proxy, with no admission logic of its own. What it adds is the gateway's vocabulary: the
replica becomes an ``ip:port`` endpoint, Envoy's subset hint narrows the replicas the policy may
pick (:meth:`~guard.controller.AdmissionController.redispatch` among them when its first pick
is outside), and requests that are not admitted (a ``GET /v1/models``) go to a routable
replica without a ticket. Envoy's own 5xx for a replica (no ``x-envoy-upstream-service-time``:
it could not reach it) count toward that replica's passive ejection, as the proxy's connect
failures do.

The response path feeds the ticket exactly as the proxy's relay does: status and content type,
every body chunk (first token, gaps, ``usage``, ``finish_reason``), and the end. A stream that
resets before the response ended is a client that left: the ticket is released ``canceled``
(Envoy resets the upstream request, so the replica frees the sequence's KV blocks).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest, ClientGone
from guard.admission.shedding import Rejection
from guard.admission.wait import Wait
from guard.controller import AdmissionController
from guard.errors import BodyTooLarge
from guard.proxy.health import ReplicaHealth

__all__ = ["EndpointPicker", "PickerExchange", "Route", "endpoint_of_url"]

REPLICA_HEADER = "x-kvguard-replica"
QUEUE_MS_HEADER = "x-kvguard-queue-ms"
REQUEST_ID_HEADER = "x-request-id"
# Envoy's router sets it on responses that came from the upstream, not on its own local
# replies (connect failure, upstream reset or timeout): how the EPP tells the two apart
UPSTREAM_TIME_HEADER = "x-envoy-upstream-service-time"


def endpoint_of_url(url: str) -> str:
    """``http://10.0.0.5:8000`` → ``10.0.0.5:8000`` (``[v6]:port`` for IPv6): what Envoy's
    ``ORIGINAL_DST`` cluster connects to, so the host must be an IP address."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"upstream: need http://IP:PORT, got {url!r}")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        raise ValueError(f"upstream: Envoy's ORIGINAL_DST cluster connects to an IP address, "
                         f"got the host name {parts.hostname!r} in {url!r}") from None
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{parts.port}"


@dataclass(frozen=True)
class Route:
    """Where Envoy sends the request: ``endpoint`` (``ip:port``; ``fallbacks`` after it), with
    ``body`` re-emitted; ``content_length`` is set when the body differs from the client's (a
    priced ``max_tokens``), so Envoy's ``Content-Length`` is fixed; ``request_id`` (admitted
    requests) replaces the request's ``x-request-id`` upstream, as the proxy sends it."""

    endpoint: str
    replica_id: str
    body: bytes
    content_length: int | None = None
    request_id: str | None = None  # the guard's id, sent upstream as x-request-id (admitted)
    fallbacks: tuple[str, ...] = ()  # endpoints Envoy may try, in order, if ``endpoint`` fails
    # admitted requests: arrival to dispatch (the x-kvguard-queue-ms response header)
    queue_ms: float | None = None

    @property
    def destination(self) -> str:
        """What the protocol's header and ``envoy.lb`` metadata carry: the endpoint, then the
        fallbacks, comma-separated."""
        return ",".join((self.endpoint, *self.fallbacks))


class EndpointPicker:
    """The controller and the replicas' endpoints (``replica_id`` → ``ip:port``); with
    ``num_fallbacks`` each route also names up to that many other routable replicas of the
    subset, for Envoy to try in order when the chosen one fails (its override-host load
    balancing; Envoy's ``ORIGINAL_DST`` cluster takes one endpoint only, so 0 there)."""

    def __init__(self, controller: AdmissionController, endpoints: Mapping[str, str],
                 health: ReplicaHealth | None = None, num_fallbacks: int = 0) -> None:
        if not endpoints:
            raise ValueError("replicas: the endpoint picker needs at least one replica")
        if num_fallbacks < 0:
            raise ValueError(f"fallbacks: must be >= 0, got {num_fallbacks}")
        self.num_fallbacks = num_fallbacks
        self.controller = controller
        self.health = health  # passive ejection (None: the load state's health alone)
        self.endpoints = dict(endpoints)
        self.replica_of = {endpoint: rid for rid, endpoint in self.endpoints.items()}
        self._turns = itertools.cycle(list(self.endpoints))  # requests without admission
        self.is_admitted = controller.config.is_admitted_path
        self.max_body_bytes = controller.config.max_body_bytes

    def add(self, replica_id: str, endpoint: str) -> None:
        """A replica joined the fleet (``replicas_from``)."""
        self.endpoints[replica_id] = endpoint
        self.replica_of[endpoint] = replica_id
        self._turns = itertools.cycle(list(self.endpoints))

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet and nothing runs on it any more."""
        endpoint = self.endpoints.pop(replica_id, None)
        if self.replica_of.get(endpoint) == replica_id:
            del self.replica_of[endpoint]
        self._turns = itertools.cycle(list(self.endpoints))

    def exchange(self, client_gone: ClientGone | None = None) -> PickerExchange:
        """One HTTP request's calls (one ext_proc stream)."""
        return PickerExchange(self, client_gone)

    def routable(self, replica_id: str) -> bool:
        health = self.health
        return self.controller.load_state.is_healthy(replica_id) and (
            health is None or not health.is_ejected(replica_id))

    def observe_answer(self, replica_id: str, status: int, from_replica: bool) -> None:
        """What became of a request sent to ``replica_id``: a 5xx that Envoy answered itself
        (``from_replica`` False: it could not connect, or the replica reset or timed out) is
        the replica's failure; anything the replica answered is a success."""
        if self.health is None:
            return
        if status >= 500 and not from_replica:
            self.health.record_failure(replica_id)
        else:
            self.health.record_success(replica_id)

    def subset_ids(self, subset: Sequence[str] | None) -> list[str]:
        """The replicas the hint allows (all of them without a hint), in configured order."""
        if not subset:
            return list(self.endpoints)
        allowed = {self.replica_of[e] for e in subset if e in self.replica_of}
        return [rid for rid in self.endpoints if rid in allowed]

    def fallbacks(self, replica_id: str, allowed: Sequence[str]) -> tuple[str, ...]:
        """Up to ``num_fallbacks`` endpoints of routable replicas among ``allowed`` other than
        ``replica_id``: the ones after it in configured order, wrapping around (so the
        fallbacks of different picks spread)."""
        if not self.num_fallbacks:
            return ()
        order = list(self.endpoints)
        start = order.index(replica_id) + 1
        found = []
        for rid in order[start:] + order[:start - 1]:
            if rid in allowed and self.routable(rid):
                found.append(self.endpoints[rid])
                if len(found) == self.num_fallbacks:
                    break
        return tuple(found)

    def any_routable(self, allowed: Sequence[str]) -> str | None:
        """A routable replica among ``allowed``, taking turns (None: there is none)."""
        for _ in range(len(self.endpoints)):
            rid = next(self._turns, None)
            if rid is None:  # the fleet is empty
                return None
            if rid in allowed and self.routable(rid):
                return rid
        return None


class PickerExchange:
    """One request through the picker: see the module docstring for the order of calls."""

    __slots__ = ("picker", "client_gone", "path", "method", "headers", "_chunks", "_num_bytes",
                 "over_limit", "admitted", "route")

    def __init__(self, picker: EndpointPicker, client_gone: ClientGone | None) -> None:
        self.picker = picker
        self.client_gone = client_gone
        self.path = ""
        self.method = ""
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._num_bytes = 0
        self.over_limit = False
        self.admitted: Admitted | None = None
        self.route: Route | None = None

    # --- the request ------------------------------------------------------------------------
    def on_request_headers(self, headers: Mapping[str, str]) -> None:
        self.headers = dict(headers)
        self.method = self.headers.get(":method", "")
        self.path = self.headers.get(":path", "").partition("?")[0]

    def add_body(self, chunk: bytes) -> bool:
        """One request body chunk; True once the body passed ``max_body_bytes`` (decide now:
        the answer is a 413 and the rest of the body is not wanted)."""
        self._num_bytes += len(chunk)
        if self._num_bytes > self.picker.max_body_bytes:
            self.over_limit = True
            self._chunks.clear()
        elif chunk:
            self._chunks.append(chunk)
        return self.over_limit

    async def decide(self, subset: Sequence[str] | None = None) -> Route | Rejection | None:
        """Where the request goes (a :class:`Route`), the rejection to answer with, or None
        when the client left before a decision (nothing to send)."""
        picker = self.picker
        allowed = picker.subset_ids(subset)
        if not allowed:
            return Rejection(503, "no_endpoint_in_subset",
                             "no replica of this picker is in the gateway's endpoint subset")
        body = b"".join(self._chunks)
        if self.method != "POST" or not picker.is_admitted(self.path):
            if self.over_limit:
                error = BodyTooLarge(picker.max_body_bytes)
                return Rejection(error.status, error.reason, str(error))
            rid = picker.any_routable(allowed)
            if rid is None:
                return Rejection(503, "no_replica", "no replica is routable", should_retry=True,
                                 retry_after_s=1.0)
            self.route = Route(picker.endpoints[rid], rid, body,
                               fallbacks=picker.fallbacks(rid, allowed))
            return self.route
        unread = BodyTooLarge(picker.max_body_bytes) if self.over_limit else None
        request = AdmissionRequest(self.path, _plain_headers(self.headers), body,
                                   self.client_gone, unread)
        controller = picker.controller
        result = controller.decide(request)
        if isinstance(result, Wait):
            result = await controller.wait(result)
        if not isinstance(result, Admitted):
            return result
        self.admitted = result
        if result.replica_id not in allowed and controller.redispatch(result, allowed) is None:
            result.on_start(503, b"application/json")
            result.finish()
            self.admitted = None
            return Rejection(503, "no_endpoint_in_subset",
                             "the policy admits this request on no replica of the subset")
        rid = result.replica_id
        length = len(result.body) if result.body_rewritten else None
        self.route = Route(picker.endpoints[rid], rid, result.body, length, result.request_id,
                           picker.fallbacks(rid, allowed), result.queue_ms)
        return self.route

    @property
    def request_id(self) -> str | None:
        """The guard's id of the admitted request (None: nothing admitted, or released)."""
        return None if self.admitted is None else self.admitted.request_id

    # --- the response -----------------------------------------------------------------------
    def on_response_headers(self, headers: Mapping[str, str],
                            served_endpoint: str | None = None) -> list[tuple[str, str]]:
        """The upstream's response head (``:status``, ``content-type``) and the endpoint Envoy
        reports it served the request from (``x-gateway-destination-endpoint-served``, when
        sent); the headers the EPP adds to it (which replica, the queue time, the guard's
        request id). Served from a fallback: the chosen replica failed (a failure toward its
        ejection) and the reservation moves to the one that served."""
        admitted, route = self.admitted, self.route
        if route is None:
            return []
        if served_endpoint is not None and served_endpoint != route.endpoint:
            route = self._served_from(route, served_endpoint)
        added = [(REPLICA_HEADER, route.replica_id)]
        if admitted is None:
            return added
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        self.picker.observe_answer(route.replica_id, status, UPSTREAM_TIME_HEADER in headers)
        admitted.on_start(status, headers.get("content-type", "").encode("latin-1"))
        added.append((QUEUE_MS_HEADER, f"{admitted.queue_ms:.1f}"))
        if REQUEST_ID_HEADER not in headers:
            added.append((REQUEST_ID_HEADER, admitted.request_id))
        return added

    def _served_from(self, route: Route, served_endpoint: str) -> Route:
        picker = self.picker
        served_id = picker.replica_of.get(served_endpoint)
        if served_id is None:  # not one of this picker's replicas: nothing to move
            return route
        if picker.health is not None:
            picker.health.record_failure(route.replica_id)
        if self.admitted is not None:
            picker.controller.served_by(self.admitted, served_id)
        self.route = route = dataclasses.replace(route, endpoint=served_endpoint,
                                                 replica_id=served_id, fallbacks=())
        return route

    def on_response_body(self, chunk: bytes, end: bool) -> None:
        """One response chunk on its way to the client; ``end``: the response is whole."""
        admitted = self.admitted
        if admitted is None:
            return
        admitted.on_body(chunk, not end)
        admitted.on_forwarded()
        if end:
            admitted.finish()
            self.admitted = None

    def close(self, reset: bool) -> None:
        """The ext_proc stream is over. ``reset``: it was cut (the client left, or Envoy went)
        before the response ended: the ticket is released ``canceled``; otherwise a ticket
        still held ends with its natural outcome (a response that never ended: ``failed``)."""
        admitted, self.admitted = self.admitted, None
        if admitted is None:
            return
        if reset:
            admitted.on_disconnect()
        admitted.finish()


def _plain_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request's headers without Envoy's pseudo-headers (``:path``, ``:method``, …)."""
    return {name: value for name, value in headers.items() if not name.startswith(":")}


