"""``MetricsEndpoint``: the EPP's Prometheus series over plain HTTP (``--metrics-port``).

The EPP speaks gRPC to Envoy; its metrics (the same ``kvguard_*`` series as the proxy's:
outcomes, TTFT/ITL histograms, held tickets, queue, per-replica KV blocks) are served by a
minimal HTTP/1.1 responder on the EPP's own event loop: ``GET /metrics`` answers the text
format, anything else 404, one request per connection.
"""

from __future__ import annotations

import asyncio

from guard.observe.metrics import CONTENT_TYPE_LATEST, GuardMetrics

__all__ = ["MetricsEndpoint"]

_MAX_HEAD_BYTES = 8192
_READ_TIMEOUT_S = 5.0


class MetricsEndpoint:
    """Serves ``metrics`` at ``GET /metrics`` once :meth:`start` returned the bound port."""

    def __init__(self, metrics: GuardMetrics) -> None:
        self.metrics = metrics
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._answer, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError):
            writer.close()
            return
        method, _, rest = head[:_MAX_HEAD_BYTES].partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method == b"GET" and path == b"/metrics":
            status, content_type, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), self.metrics.render()
        else:
            status, content_type, body = b"404 Not Found", b"text/plain", b"not found\n"
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type +
                     b"\r\ncontent-length: " + str(len(body)).encode() +
                     b"\r\nconnection: close\r\n\r\n" + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
