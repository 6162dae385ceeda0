"""HTTP/1.1 relayed on raw asyncio protocols: ``python -m chaos.passthrough --mode http``.

No ASGI server and no client library. Each client connection's request head is parsed and
re-framed (hop-by-hop headers dropped, ``host`` and ``content-length`` set) onto a pooled
keep-alive upstream connection; the response head is parsed and re-written, and the body bytes
go to the client as they arrive while their framing (``content-length`` or chunked) is followed
to find the end, when the upstream connection goes back to the pool. A client that leaves
mid-response closes its upstream connection. One request at a time per connection (no
pipelining), no timeouts, no limits: it measures what HTTP handling in Python costs without
the stacks, it is not a server to deploy.
"""

from __future__ import annotations

import asyncio

from guard.proxy.upstream_contract import HOP_BY_HOP
from serving.chunked import ChunkedDecoder

__all__ = ["HttpRelay"]

_REQUEST_HOP_BY_HOP = HOP_BY_HOP  # the proxy's: host and content-length are set again here
_RESPONSE_HOP_BY_HOP = frozenset({b"connection", b"keep-alive"})  # framing headers stay as sent


def _head_lines(head: bytes, drop: frozenset[bytes]) -> tuple[list[bytes], dict[bytes, bytes]]:
    """The head's start line and kept header lines, and every header by lower-case name."""
    lines = head.split(b"\r\n")
    kept, fields = [lines[0]], {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        fields[name] = value.strip()
        if name not in drop:
            kept.append(line)
    return kept, fields


class _BodyEnd:
    """Follows a response body's framing; ``feed(data)`` is True once the body is complete
    (chunked framing through the decoder kvguard's own HTTP halves use)."""

    def __init__(self, fields: dict[bytes, bytes]) -> None:
        chunked = b"chunked" in fields.get(b"transfer-encoding", b"").lower()
        self.chunks = ChunkedDecoder(trailer_field=None) if chunked else None
        self.left = -1 if chunked else int(fields.get(b"content-length", b"-1"))

    def feed(self, data: bytes) -> bool:
        if self.chunks is None:
            self.left -= len(data)
            return self.left == 0 if self.left >= 0 else False  # no length: ends at close
        self.chunks.decode(data, [])
        return self.chunks.done


class _Upstream(asyncio.Protocol):
    """One pooled upstream connection, relaying one response at a time to its client."""

    def __init__(self, relay: HttpRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self._head: bytes | None = None
        self._end: _BodyEnd | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, client: asyncio.Transport, request: bytes) -> None:
        self.client, self._head, self._end = client, b"", None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.client is None:
            return
        if self._head is not None:
            self._head += data
            split = self._head.find(b"\r\n\r\n")
            if split < 0:
                return
            head, data = self._head[:split], self._head[split + 4:]
            self._head = None
            kept, fields = _head_lines(head, _RESPONSE_HOP_BY_HOP)
            self._end = _BodyEnd(fields)
            self.client.write(b"\r\n".join(kept) + b"\r\n\r\n")
            if self._end.left == 0:  # an empty body
                return self.relay.release(self)
        if data:
            self.client.write(data)
        if self._end.feed(data):
            self.relay.release(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.lost(self)
        if self.client is not None:
            self.client.close()


class _Client(asyncio.Protocol):
    """One client connection: each complete request is re-framed and handed to the relay."""

    def __init__(self, relay: HttpRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        split = self._buffer.find(b"\r\n\r\n")
        if split < 0:
            return
        kept, fields = _head_lines(self._buffer[:split], _REQUEST_HOP_BY_HOP)
        length = int(fields.get(b"content-length", b"0"))
        if len(self._buffer) < split + 4 + length:
            return
        body = self._buffer[split + 4:split + 4 + length]
        self._buffer = self._buffer[split + 4 + length:]
        kept += [b"host: " + self.relay.host_header, b"content-length: %d" % len(body)]
        self.relay.forward(self, b"\r\n".join(kept) + b"\r\n\r\n" + body)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.client is self.transport:
            self.upstream.transport.close()  # mid-response: the upstream sees its client go


class HttpRelay:
    """The pool of keep-alive upstream connections behind ``http`` mode's clients."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.host_header = f"{host}:{port}".encode()
        self._idle: list[_Upstream] = []

    def __call__(self) -> asyncio.Protocol:
        return _Client(self)

    def forward(self, client: _Client, request: bytes) -> None:
        if self._idle:
            client.upstream = self._idle.pop()
            client.upstream.send(client.transport, request)
        else:
            asyncio.get_running_loop().create_task(self._open(client, request))

    async def _open(self, client: _Client, request: bytes) -> None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(
                lambda: _Upstream(self), self.host, self.port)
        except OSError:
            client.transport.close()
            return
        client.upstream = upstream
        upstream.send(client.transport, request)

    def release(self, upstream: _Upstream) -> None:
        upstream.client = None
        self._idle.append(upstream)

    def lost(self, upstream: _Upstream) -> None:
        if upstream in self._idle:
            self._idle.remove(upstream)
