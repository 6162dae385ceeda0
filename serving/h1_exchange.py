"""One request/response cycle on an ``serving.h1_connection.H1Connection``: the ASGI
``receive`` and ``send`` of one request.

``receive()`` hands the app the request body as it arrives (content-length or chunked, already
decoded by the connection), then ``http.disconnect`` once the connection is lost or the
response has ended; several receives may wait at once (the proxy reads the body and watches
for the disconnect separately). ``send()`` writes the response head at once and each body
message at once: ``content-length`` when the app gave one, chunked otherwise (HTTP/1.0: until
the connection closes), nothing for HEAD, 1xx, 204 and 304 — except that a head announcing a
non-empty ``content-length`` body goes out in the same write as the body's first bytes (a
shed's 503 is one ``send`` syscall and one segment, not two; the client can do nothing with
such a head before its body anyway); while the client does not read,
a ``more_body`` send waits for the write buffer to drain. An app that raises or returns
before the response ended is answered 500 (nothing sent yet) or cut (``H1Connection.fail``).

The scope's ``extensions`` carry ``kvguard.disconnect``: ``{"future": gone}`` where ``gone()``
returns one future (made on first use) that completes when the connection is lost before the
response ended, so an app can watch for its client leaving without a task waiting in
``receive()`` (the proxy does, for every relayed request); and ``kvguard.body``:
``{"write": write_body, "drain": drain, "take": take_body}``, where ``take_body()`` returns the
whole request body when all of it has arrived and none was received yet (the ``receive()``
that would return it, without a coroutine; None otherwise), and ``write_body(body, more_body)`` is
``send()`` of an ``http.response.body`` message done at once, from any callback (True: the
client is not reading, await ``drain()`` before writing more), so a relay can hand on each
upstream read from the upstream protocol's own callback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any, Protocol

from serving.h1_head import ChunkedBody, RequestHead

__all__ = ["Exchange", "ExchangeConnection", "error_response"]

log = logging.getLogger("kvguard.http")

_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode())
                 for s in HTTPStatus}
_DISCONNECT = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ERROR_CODES = {400: "bad_request", 431: "request_header_fields_too_large",
                500: "internal_error", 505: "http_version_not_supported"}


class ExchangeConnection(Protocol):
    """What an exchange needs of its connection (``serving.h1_connection.H1Connection``)."""

    loop: asyncio.AbstractEventLoop
    server: Any  # .date_header, .draining
    transport: asyncio.Transport
    write_paused: bool

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def body_read(self) -> None: ...

    def response_complete(self, exchange: Exchange) -> None: ...

    def fail(self, exchange: Exchange) -> None: ...


def error_response(status: int, message: str) -> bytes:
    """A complete JSON error answer that closes the connection."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": _ERROR_CODES.get(status, "error")}}).encode()
    return (_STATUS_LINES[status] + b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body)


class Exchange:
    """One request/response cycle: the ASGI ``receive`` and ``send`` of one request."""

    __slots__ = ("conn", "task", "method", "keep_alive", "http10", "expect_continue",
                 "more_body", "body_left", "chunks", "_body", "num_buffered", "_delivered",
                 "disconnected",
                 "started", "complete", "_waiter", "_chunked_out", "_length_left", "_no_body",
                 "_held_head",
                 "_gone")

    def __init__(self, conn: ExchangeConnection, request: RequestHead) -> None:
        self.conn = conn
        self.task: asyncio.Task | None = None
        self.method = request.method
        self.keep_alive = request.keep_alive
        self.http10 = request.http_version == "1.0"
        self.expect_continue = request.expect_continue
        self.chunks = ChunkedBody() if request.chunked else None
        self.body_left = request.content_length or 0
        self.more_body = request.chunked or self.body_left > 0  # request body still arriving
        self._body: list[bytes] = []
        self.num_buffered = 0  # body bytes received, not yet given to the app
        self._delivered = False  # the last http.request message went to the app
        self.disconnected = False
        self.started = False
        self.complete = False
        self._waiter: asyncio.Event | None = None
        self._chunked_out = False
        self._length_left: int | None = None
        self._held_head = b""  # a content-length head, written with the first body bytes
        self._no_body = False
        self._gone: asyncio.Future | None = None  # gone(): the client left

    async def run(self, app: Any, scope: dict | None = None) -> None:
        """The ASGI ``app`` on this request's ``scope``, or (no scope) ``app`` is the awaitable
        an app's direct handler left to do (``serving.h1server``); a failure or an incomplete
        response is answered 500 or cut."""
        try:
            await (app if scope is None else app(scope, self.receive, self.send))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.error("Exception in ASGI application", exc_info=exc)
            if not self.complete:
                self.fail()
            if not isinstance(exc, Exception):
                raise
        else:
            if not self.complete:
                if not self.disconnected:
                    log.error("ASGI app returned without completing the response")
                self.fail()

    def fail(self) -> None:
        """The app ended without completing the response: a head held back for its body goes
        out first, so the client sees the response cut, as when the head was written."""
        if self._held_head and not self.disconnected:
            self.conn.write(self._held_head)
        self._held_head = b""
        self.conn.fail(self)

    # --- the request body and the disconnect, for receive() -----------------------------------
    def add_body(self, data: bytes, last: bool) -> None:
        if data:
            self._body.append(data)
            self.num_buffered += len(data)
        if self.chunks is None:
            self.body_left -= len(data)
        if last:
            self.more_body = False
        self._wake()

    def lost(self) -> None:
        self.disconnected = True
        self._wake()
        gone = self._gone
        if gone is not None and not gone.done() and not self.complete:
            gone.set_result(_DISCONNECT)

    def gone(self) -> asyncio.Future:
        """A future that completes (with the ``http.disconnect`` message) when the connection
        is lost before the response ended; the same one on every call."""
        gone = self._gone
        if gone is None:
            self._gone = gone = self.conn.loop.create_future()
            if self.disconnected and not self.complete:
                gone.set_result(_DISCONNECT)
        return gone

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()

    async def receive(self) -> dict:
        while True:
            if self.disconnected or self.complete:
                return _DISCONNECT
            if not self._delivered and (self._body or not self.more_body):
                body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
                self._body.clear()
                self.num_buffered = 0
                self._delivered = not self.more_body
                self.conn.body_read()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            if self.expect_continue:
                self.expect_continue = False
                if not self.started:
                    self.conn.write(_CONTINUE)
            if self._waiter is None:  # an Event: the body reader and a disconnect watch
                self._waiter = asyncio.Event()  # may both wait
            self._waiter.clear()
            await self._waiter.wait()

    def take_body(self) -> bytes | None:
        """The whole request body, when all of it arrived and ``receive()`` gave none of it
        yet (then ``receive()`` goes on as after that message); None otherwise."""
        if self.more_body or self._delivered or self.disconnected or self.complete:
            return None
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.num_buffered = 0
        self._delivered = True
        self.conn.body_read()  # reading resumes if it paused for this body
        return data

    # --- the response, for send() -------------------------------------------------------------
    def write_body(self, body: bytes, more: bool) -> bool:
        """An ``http.response.body`` message, written now; True when the client stopped
        reading (await ``conn.drain()`` before the next)."""
        if not self.started or self.complete:
            raise RuntimeError("http.response.body before http.response.start or after "
                               "the response ended")
        if self.disconnected:
            return False
        if more and body and self._chunked_out:  # a streamed piece (the common case), here:
            conn = self.conn                     # one frame less per token than below
            conn.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
            return conn.write_paused
        self._write_body(body, more)
        if not more:
            self.complete = True
            self._wake()
            self.conn.response_complete(self)
            return False
        return self.conn.write_paused

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.write_body(message.get("body", b""), message.get("more_body", False)):
                await self.conn.drain()
        elif kind == "http.response.start":
            self.start_response(message["status"], message.get("headers", ()))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def start_response(self, status: int, headers: Any) -> None:
        """An ``http.response.start`` message, done now (from any callback)."""
        if self.started:
            raise RuntimeError("http.response.start sent twice")
        head = self._head(status, headers)
        self.started = True  # a head that fails to build is still answered 500
        if self._length_left:  # a fixed-length body follows: one write for both
            self._held_head = head
        elif not self.disconnected:
            self.conn.write(head)

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        """A whole response written now, from any callback (a direct handler's answer)."""
        self.start_response(status, headers)
        self.write_body(body, False)

    def _head(self, status: int, headers: Any) -> bytes:
        line = _STATUS_LINES.get(status)
        if line is None:
            if not 100 <= status <= 999:
                raise RuntimeError(f"invalid HTTP status {status!r}")
            line = b"HTTP/1.1 %d \r\n" % status
        parts = [line, self.conn.server.date_header]
        length = None
        for name, value in headers:
            name = name.lower()
            field = b"%s: %s\r\n" % (name, value)
            # no CR or LF in the name or value (the line's own ending is its only pair) and no
            # colon in the name; counts and find, not ``b"\n" in value``: bytes ``in`` first
            # tries its operand as an int and formats the TypeError it discards (~40 a request)
            if field.count(b"\n") != 1 or field.count(b"\r") != 1 or name.find(b":") >= 0:
                raise RuntimeError(f"invalid response header {name!r}")
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                continue  # the server frames the body itself
            elif name == b"connection":
                if value.lower().find(b"close") >= 0:
                    self.keep_alive = False
                continue
            parts.append(field)
        self._no_body = self.method == "HEAD" or status in (204, 304) or status < 200
        if not self._no_body:
            if length is not None:
                self._length_left = length
            elif self.http10:
                self.keep_alive = False  # the body ends when the connection closes
            else:
                self._chunked_out = True
                parts.append(b"transfer-encoding: chunked\r\n")
        if self.conn.server.draining or self.more_body:
            self.keep_alive = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        elif self.http10:
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _write_body(self, body: bytes, more: bool) -> None:
        conn = self.conn
        if self._no_body:
            return
        if self._chunked_out:
            if body:
                out = b"%x\r\n%s\r\n" % (len(body), body)
                conn.write(out + b"0\r\n\r\n" if not more else out)
            elif not more:
                conn.write(b"0\r\n\r\n")
            return
        if self._length_left is not None:
            self._length_left -= len(body)
            if self._length_left < 0:
                raise RuntimeError("response body longer than its content-length")
            if not more and self._length_left:
                self.keep_alive = False  # cut short: the client must see the connection end
            if self._held_head:  # the head, in the same write as the first body bytes
                body, self._held_head = self._held_head + body, b""
        if body:
            conn.write(body)
