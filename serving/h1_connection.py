"""One client connection of ``serving.h1server``: HTTP/1.1 on an asyncio protocol, the
``ServerLimits`` enforced natively, one ASGI request cycle at a time.

Phases, one deadline at a time (as ``serving.limited_protocol`` gives uvicorn):

    head     accepted, or the first byte of the next request arrived: head within header_timeout_s
    body     head complete, body still arriving: body within body_timeout_s (total)
    serving  the request is read; the response streams for as long as it takes, but a client
             that stops reading (writes paused) is cut after write_timeout_s
    idle     response complete, connection kept alive: next byte within keep_alive_timeout_s

A head or body deadline that passes closes the connection and counts it in the
``ConnectionTable`` (``header_timeout``, ``body_timeout``; ``write_timeout`` aborts it); the app
then sees ``http.disconnect``. A connection over a cap gets the 503 refusal. A malformed request
(``serving.h1_head``) is answered 400 / 431 / 505 and closed without reaching the app; so is a
head with a bare LF, as soon as it arrives.

A request pipelined behind another waits in the buffer until the first response ends; reading
pauses while more than 256 KiB of request bytes wait for the app. Each request's ASGI
``receive``/``send`` is an ``Exchange`` (``serving.h1_exchange``); its app starts from the read
callback that completed the head, its first step run at once inside its task
(``serving.eager_task``), not one loop iteration later. An app with a direct handler
(``http_direct``, see ``serving.h1server``) is offered each request first, once its body is in:
a ``content-length`` body of up to 256 KiB that did not come with the head is waited for (under
the body deadline) before anything of the app runs, unless the client expects ``100-continue``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from serving.eager_task import start_eagerly
from serving.h1_exchange import Exchange, error_response
from serving.h1_head import MAX_HEAD_BYTES, BadRequest, RequestHead, parse_head
from serving.limited_protocol import REFUSAL, REFUSAL_LINGER_S, PhaseDeadlines

__all__ = ["H1Connection"]

log = logging.getLogger("kvguard.http")

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_MAX_BUFFERED = 256 * 1024  # unread request bytes before reading pauses


class H1Connection(PhaseDeadlines, asyncio.Protocol):
    """``server`` is the ``serving.h1server.H1Server`` (app, table, lifespan state, date)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.limits = server.table.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self._client_addr: str | None = None  # set once counted in the table
        self._buffer = bytearray()
        self._phase = "head"
        self._deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self.write_paused = False
        self._drained: asyncio.Future | None = None  # sends wait on it while writes are paused
        self._read_paused = False
        self._lingering = False  # answered and half-closed: further input is discarded
        self._client: tuple | None = None
        self._server_addr: tuple | None = None
        self._held: RequestHead | None = None  # its app not started until its body is in

    # --- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if peer else "unknown"
        if not self.server.table.try_open(client):
            self._linger(REFUSAL)
            return
        self._client_addr = client
        self._client = (peer[0], peer[1]) if peer else None
        sockname = transport.get_extra_info("sockname")
        self._server_addr = (sockname[0], sockname[1]) if sockname else None
        self.server.connections.add(self)
        self._arm("head", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None
        if self._client_addr is None:
            return  # refused: never counted
        self.server.table.release(self._client_addr)
        self._client_addr = None
        self._held = None
        self.server.connections.discard(self)
        if self.exchange is not None:
            self.exchange.lost()
        self._wake_sends()

    def data_received(self, data: bytes) -> None:
        if self._client_addr is None or self._lingering:
            return
        if self._phase == "idle":  # the first byte of the next request
            self._arm("head", self.limits.header_timeout_s)
        self._buffer += data
        self._advance()

    def pause_writing(self) -> None:
        """The client stopped reading: it has ``write_timeout_s`` to start again."""
        self.write_paused = True
        if self._write_deadline is None and self._client_addr is not None:
            self._write_deadline = self.loop.call_later(self.limits.write_timeout_s,
                                                        self._expire_write)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None
        self._wake_sends()

    # --- reading requests ---------------------------------------------------------------------
    def _advance(self) -> None:
        """Move the buffered bytes on: into the current request's body, or into a new head."""
        exchange = self.exchange
        if exchange is not None:
            if exchange.more_body and self._buffer:
                self._feed_body(exchange)
            if (len(self._buffer) > _MAX_BUFFERED or exchange.num_buffered > _MAX_BUFFERED) \
                    and not self._read_paused:
                # a body the app does not read yet, or a client pipelining far ahead
                self._read_paused = True
                self.transport.pause_reading()
            return
        buffer = self._buffer
        while buffer[:2] == b"\r\n":  # empty lines before a request line are ignored
            del buffer[:2]
        end = buffer.find(b"\r\n\r\n")
        head_end = len(buffer) if end < 0 else end
        if buffer.count(b"\n", 0, head_end) != buffer.count(b"\r\n", 0, head_end):
            # a bare LF ends lines for some parsers and not for others: refused now, not held
            # until the header timeout
            self._reject(BadRequest(400, "a bare LF in the request head"))
            return
        if end < 0 or end > MAX_HEAD_BYTES:
            if end > MAX_HEAD_BYTES or len(buffer) > MAX_HEAD_BYTES + 3:
                self._reject(BadRequest(431, "request head too large"))
            return
        head = bytes(buffer[:end])
        del buffer[:end + 4]
        try:
            request = parse_head(head)
        except (BadRequest, UnicodeDecodeError) as exc:
            self._reject(exc if isinstance(exc, BadRequest) else BadRequest(400, "bad path"))
            return
        self._start(request)

    def _start(self, request: RequestHead) -> None:
        exchange = Exchange(self, request)
        self.exchange = exchange
        if exchange.more_body and self._buffer:  # the body, or its start, came with the head
            self._feed_body(exchange)
        # (a malformed chunked body was refused: no phase; the ASGI app still runs and sees
        # the disconnect)
        if exchange.more_body and not exchange.disconnected:
            self._arm("body", self.limits.body_timeout_s)
            if self.server.direct is not None and not request.expect_continue and \
                    exchange.chunks is None and exchange.body_left <= _MAX_BUFFERED:
                self._held = request  # a direct handler gets it whole: served once it is in
                return
        elif not exchange.disconnected:  # the whole request is read: one phase change, not
            self._arm("serving", None)   # head → body → serving
        self._serve(request, exchange)

    def _serve(self, request: RequestHead, exchange: Exchange) -> None:
        """The app's direct handler when the body is in and it takes the request; else the
        ASGI app."""
        server = self.server
        if server.direct is not None and not exchange.more_body and not exchange.disconnected \
                and self._run_direct(server.direct, request, exchange):
            return
        scope = {"type": "http", "asgi": _ASGI, "http_version": request.http_version,
                 "server": self._server_addr, "client": self._client, "scheme": "http",
                 "method": request.method, "root_path": "", "path": request.path,
                 "raw_path": request.raw_path, "query_string": request.query_string,
                 "headers": request.headers, "state": server.lifespan_state.copy()}
        scope["extensions"] = {"kvguard.disconnect": {"future": exchange.gone},
                               "kvguard.body": {"write": exchange.write_body,
                                                "drain": self.drain,
                                                "take": exchange.take_body}}
        # from the read callback the app's first step runs now (the proxy's request is priced,
        # admitted and sent upstream before the loop polls again); from a task, next iteration
        self._run(exchange, exchange.run(server.app, scope))

    def _run_direct(self, direct: Any, request: RequestHead, exchange: Exchange) -> bool:
        """The app's ``http_direct(request, exchange)`` (see ``serving.h1server``): False when
        it leaves the request to ASGI; True when it answered (no task: one that says so and
        did not complete the response is answered 500 or cut); else the coroutine it
        returned runs as the request's task. One that raises is answered 500, as an ASGI app
        that raises."""
        try:
            rest = direct(request, exchange)
        except Exception as exc:  # noqa: BLE001 - the request's failure, not the server's
            log.error("Exception in the app's direct request handler", exc_info=exc)
            exchange.fail()
            return True
        if rest is None:
            return False
        if rest is True:
            if not exchange.complete:
                if not exchange.disconnected:
                    log.error("the app's direct handler answered without completing the response")
                exchange.fail()
            return True
        self._run(exchange, exchange.run(rest))
        return True

    def _run(self, exchange: Exchange, call: Any) -> None:
        """The request's task, its first step run here and now (``serving.eager_task``)."""
        exchange.task = task = start_eagerly(self.loop, call)
        self.server.tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self.server.tasks.discard)

    def _feed_body(self, exchange: Exchange) -> None:
        buffer = self._buffer
        if exchange.chunks is None:
            size = min(exchange.body_left, len(buffer))
            exchange.add_body(bytes(buffer[:size]), exchange.body_left == size)
            del buffer[:size]
        else:
            try:
                data, used = exchange.chunks.feed(bytes(buffer))
            except BadRequest as exc:
                exchange.lost()
                self._reject(exc, answer=not exchange.started)
                return
            del buffer[:used]
            exchange.add_body(data, exchange.chunks.done)
        if not exchange.more_body and self._phase == "body":
            self._arm("serving", None)
            held = self._held
            if held is not None:  # its body came after its head: the request is served now
                self._held = None
                self._serve(held, exchange)

    def body_read(self) -> None:
        """The app took the body buffered so far: read on if reading was paused for it."""
        if self._read_paused and len(self._buffer) <= _MAX_BUFFERED and \
                not self.transport.is_closing():
            self._read_paused = False
            self.transport.resume_reading()

    # --- writing responses --------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        if self.write_paused and not self.transport.is_closing():
            if self._drained is None:
                self._drained = self.loop.create_future()
            await self._drained

    def _wake_sends(self) -> None:
        if self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None

    def response_complete(self, exchange: Exchange) -> None:
        """The response ended: keep the connection for the next request, or close it."""
        if exchange.more_body or not exchange.keep_alive or self.server.draining:
            self.transport.close()
            return
        self.exchange = None
        self._arm("idle", self.limits.keep_alive_timeout_s)
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        if self._buffer:  # a pipelined request is waiting
            self._arm("head", self.limits.header_timeout_s)
            self._advance()

    def fail(self, exchange: Exchange) -> None:
        """The app raised or returned early: 500 if nothing was sent yet, else cut."""
        if exchange.disconnected or self._lingering or self.transport.is_closing():
            return  # gone, or already answered
        if not exchange.started:
            self._linger(error_response(500, "Internal Server Error"))
        else:
            self.transport.close()

    def close_if_idle(self) -> None:
        """Drain: a connection between requests closes now; one serving closes after it."""
        if self.exchange is None and not self._lingering:
            self.transport.close()

    # --- refusing -----------------------------------------------------------------------------
    def _reject(self, exc: BadRequest, answer: bool = True) -> None:
        log.debug("invalid HTTP request: %s", exc.reason)
        self._buffer.clear()
        if answer:
            self._linger(error_response(exc.status, exc.reason))
        else:
            self.transport.close()

    def _linger(self, answer: bytes) -> None:
        """Answer, then a lingering close: half-close, discard what the client still sends,
        close when it does or after ``REFUSAL_LINGER_S`` (closing at once with its request
        unread would reset the connection and lose the answer)."""
        self._lingering = True
        self._cancel()
        transport = self.transport
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._deadline = self.loop.call_later(REFUSAL_LINGER_S, transport.close)

    # --- deadlines (serving.limited_protocol.PhaseDeadlines) -----------------------------------
    def _connection_table(self):
        return self.server.table

    def _expire_write(self) -> None:
        self._write_deadline = None
        if not self.transport.is_closing():
            self.server.table.closed("write_timeout")
        self.transport.abort()  # close() would wait for the unread buffer to drain

