"""``Passthrough``: the cheap routes the proxy relays to a replica unpriced but counted.

A request whose path matches ``[proxy] relayed_paths`` (``fnmatch`` patterns; by default
vLLM's ``/tokenize``, ``/detokenize``, ``/version``, ``/ping`` and ``/v1/models/{id}``) is not
admitted: it goes whole to one routable replica and its answer comes back whole. The replica
is one that serves the request's model (``/v1/models/{id}``'s id, or a JSON body's ``model``;
:class:`guard.proxy.model_catalog.ModelCatalog`, so an unknown model is the catalog's 404) with
the fewest requests in flight. The upstream gets the client's end-to-end headers less the
client's ``Authorization`` (unless the config forwards it), with the replica's own key when it
has one, exactly as admitted requests. ``kvguard_proxy_relayed_requests_total{route,status}``
counts them (``route``: the pattern that matched). A ``GET`` is answered with the replica's
status and body, typed ``application/json`` when the body is JSON and ``text/plain`` otherwise
(the proxy's GET client keeps no response headers); a ``POST`` with the replica's headers.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from guard.admission.shedding import Rejection
from guard.errors import PricingError
from guard.proxy.transports import Transport, UpstreamError

__all__ = ["Passthrough"]

_MODEL_PREFIX = "/v1/models/"
RawHeaders = list[tuple[bytes, bytes]]
Send = Callable[[dict], Awaitable[None]]


class Passthrough:
    """``relayed_paths`` matched and relayed. ``pick(model)`` is the replica to use (None: no
    routable one); ``upstream_headers(replica_id, raw)`` the headers that replica gets."""

    def __init__(self, patterns: Iterable[str], transport: Transport, urls: dict[str, str],
                 pick: Callable[[object], str | None],
                 upstream_headers: Callable[[str, RawHeaders], RawHeaders],
                 registry: CollectorRegistry, timeout_s: float) -> None:
        self.patterns = tuple(patterns)
        self._transport = transport
        self._urls = urls
        self._pick = pick
        self._upstream_headers = upstream_headers
        self._timeout_s = timeout_s
        self._relayed = Counter("kvguard_proxy_relayed_requests",
                                "Unpriced requests relayed to a replica (relayed_paths)",
                                ["route", "status"], registry=registry)

    def route(self, path: str) -> str | None:
        """The pattern ``path`` matches (None: not a relayed path)."""
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(path, pattern):
                return pattern
        return None

    async def relay(self, route: str, method: str, path: str, target: str, raw: RawHeaders,
                    body: bytes, send: Send) -> None:
        """One relayed request (``path`` decoded; ``target`` as the client sent it, query
        included), answered; a rejection when no replica can take it."""
        try:
            replica_id = self._pick(_model_of(path, body))
        except PricingError as error:
            return await self._reject(route, send, Rejection(error.status, error.reason,
                                                             error.message, param=error.param))
        if replica_id is None:
            return await self._reject(route, send, Rejection(
                503, "no_replica", "No replica can serve this request now (none is routable).",
                1.0, True))
        url = self._urls[replica_id] + target
        headers = self._upstream_headers(replica_id, raw)
        try:
            if method == "GET":
                status, answer = await self._transport.get(url, self._timeout_s, headers)
                return await self._answer(route, send, replica_id, status,
                                          [(b"content-type", _content_type(answer))], [answer])
            response = await self._transport.send(url, headers, body)
            try:
                chunks = [chunk async for chunk in response.chunks()]
            finally:
                await response.aclose()
        except UpstreamError:
            return await self._reject(route, send, Rejection(
                502, "upstream_failed", f"replica {replica_id} did not answer", 1.0, True))
        await self._answer(route, send, replica_id, response.status, list(response.headers),
                           chunks)

    async def _answer(self, route: str, send: Send, replica_id: str, status: int,
                      headers: RawHeaders, chunks: Collection[bytes]) -> None:
        self._relayed.labels(route, str(status)).inc()
        body = b"".join(chunks)
        headers = [h for h in headers if h[0] != b"content-length"] + [
            (b"content-length", str(len(body)).encode()),
            (b"x-kvguard-replica", replica_id.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _reject(self, route: str, send: Send, rejection: Rejection) -> None:
        self._relayed.labels(route, str(rejection.status)).inc()
        headers, body = rejection.response()
        await send({"type": "http.response.start", "status": rejection.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _model_of(path: str, body: bytes) -> Any:
    """The model a relayed request is about: ``/v1/models/{id}``'s id, or the JSON body's."""
    if path.startswith(_MODEL_PREFIX):
        return path[len(_MODEL_PREFIX):] or None
    if body:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return data.get("model") if isinstance(data, dict) else None
    return None


def _content_type(body: bytes) -> bytes:
    try:
        json.loads(body)
    except ValueError:
        return b"text/plain; charset=utf-8"
    return b"application/json"
