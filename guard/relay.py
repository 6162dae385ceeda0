"""Relaying one admitted request through the wrapped app, watching its response stream.

:func:`relay` runs the wrapped ASGI app for an admitted request: the app gets the already-read
body as its first ``http.request`` (then the client's own later messages, so a disconnect still
reaches it as ``http.disconnect``), the scope carries the guard's ``x-request-id``, and every
response message passes through unbuffered while the :class:`~guard.ticket.Ticket` observes it
(status, content type, first token, inter-token gaps, end of stream). The guard adds
``x-kvguard-queue-ms`` and, unless the app set one, ``x-request-id`` to the response headers.
The ticket is released exactly once: with its natural outcome when the app returns, ``canceled``
or ``failed`` when it raises (re-raised).

The per-request state lives in one :class:`Relay` object whose bound ``receive``/``send`` are
handed to the app (no closures built per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from guard.ticket import Ticket

__all__ = ["Relay", "relay", "forward_scope", "start_with_headers", "REQUEST_ID_HEADER"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
_QUEUE_MS_HEADER = b"x-kvguard-queue-ms"


def forward_scope(scope: Scope, request_id: bytes) -> Scope:
    """A copy of ``scope`` whose ``x-request-id`` header is the guard's."""
    headers = []  # a plain loop: a comprehension is one more call per request
    for header in scope["headers"]:
        if header[0] != REQUEST_ID_HEADER:
            headers.append(header)
    headers.append((REQUEST_ID_HEADER, request_id))
    inner = scope.copy()
    inner["headers"] = headers
    return inner


def start_with_headers(message: Message, ticket: Ticket, request_id: bytes,
                       queue_ms: bytes) -> Message:
    """Note the status and content type; add the guard's headers (ASGI names are lower-case)."""
    headers = list(message.get("headers", ()))
    content_type = b""
    has_request_id = False
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == REQUEST_ID_HEADER:
            has_request_id = True
    ticket.on_start(message["status"], content_type)
    headers.append((_QUEUE_MS_HEADER, queue_ms))
    if not has_request_id:
        headers.append((REQUEST_ID_HEADER, request_id))
    started = message.copy()
    started["headers"] = headers
    return started


class Relay:
    """The receive/send pair the wrapped app sees for one admitted request."""

    __slots__ = ("ticket", "request_id", "_receive", "_send", "_first", "_pending", "_clock",
                 "_itl")

    def __init__(self, ticket: Ticket, receive: Receive, send: Send, body: bytes,
                 pending: asyncio.Future | None, clock: Callable[[], float], itl: Any) -> None:
        self.ticket = ticket
        self.request_id = ticket.request_id.encode()
        self._receive = receive
        self._send = send
        self._first: Message | None = {"type": "http.request", "body": body, "more_body": False}
        self._pending = pending  # a receive() already in flight while the request was queued
        self._clock = clock
        self._itl = itl  # the class's inter-token gap histogram

    async def receive(self) -> Message:
        first = self._first
        if first is not None:
            self._first = None
            return first
        pending = self._pending
        if pending is not None:
            self._pending = None
            message = await pending
        else:
            message = await self._receive()
        if message["type"] == "http.disconnect":
            self.ticket.client_disconnected = True
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        ticket = self.ticket
        if kind == "http.response.body":
            gap_s = ticket.on_body(message.get("body", b""), message.get("more_body", False),
                                   self._clock())
            if gap_s is not None:
                self._itl.observe(gap_s)
        elif kind == "http.response.start":
            message = start_with_headers(message, ticket, self.request_id, self._queue_ms())
        try:
            await self._send(message)
        except OSError:
            ticket.client_disconnected = True
            raise

    def _queue_ms(self) -> bytes:
        ticket = self.ticket
        return f"{(ticket.dispatch_s - ticket.cost.arrival_s) * 1000:.1f}".encode()

    def cancel_pending(self) -> None:
        pending = self._pending
        if pending is not None and not pending.done():
            pending.cancel()


async def relay(app: Callable, scope: Scope, receive: Receive, send: Send, body: bytes,
                ticket: Ticket, pending: asyncio.Future | None, clock: Callable[[], float],
                itl: Any) -> None:
    """Run the wrapped app for an admitted request; release its ticket exactly once."""
    state = Relay(ticket, receive, send, body, pending, clock, itl)
    try:
        await app(forward_scope(scope, state.request_id), state.receive, state.send)
    except BaseException as exc:
        gone = ticket.client_disconnected or isinstance(exc, asyncio.CancelledError)
        ticket.release("canceled" if gone else "failed")
        raise
    finally:
        state.cancel_pending()
    ticket.release(ticket.natural_outcome())
