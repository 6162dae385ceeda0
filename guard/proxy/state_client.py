"""The state poller's HTTP client in the proxy: its GETs go over the proxy's upstream transport.

:class:`guard.replicas.poller.HttpStateSource` asks a client for ``get(url, timeout=...)`` and
reads ``status_code``, ``content``, ``text`` and ``raise_for_status()`` from the answer (httpx's
shape). :class:`TransportStateClient` gives it that shape over the proxy's
:class:`guard.proxy.transports.Transport`, so every replica's ``/kvguard/state`` (or vLLM
``/metrics``) poll rides the same pooled keep-alive connections as the requests, at a fraction
of a separate HTTP client's CPU (``scripts/upstream_client_cost.py``; docs/benchmarks.md): the
poller runs ``refresh_interval_s`` apart for every replica, on the loop that relays every
token.
"""

from __future__ import annotations

from guard.proxy.upstream_contract import Transport, UpstreamError

__all__ = ["TransportStateClient", "StateResponse"]


class StateResponse:
    """One poll's answer: the part of httpx's ``Response`` the state sources read."""

    __slots__ = ("url", "status_code", "content")

    def __init__(self, url: str, status_code: int, content: bytes) -> None:
        self.url = url
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def raise_for_status(self) -> None:
        if not 200 <= self.status_code < 300:
            raise UpstreamError(f"GET {self.url} answered HTTP {self.status_code}")


class TransportStateClient:
    """``get(url, timeout=...)`` over a proxy transport (:class:`UpstreamError` on failure)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def get(self, url: str, timeout: float) -> StateResponse:
        status, body = await self._transport.get(url, timeout)
        return StateResponse(url, status, body)
