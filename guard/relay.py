"""Relaying one admitted request through the wrapped ASGI app, watching its response stream.

:meth:`Relay.run` runs the wrapped ASGI app for an :class:`~guard.admission.admitted.Admitted`
request: the app gets
the admission's body as its first ``http.request`` (then the client's own later messages, so a
disconnect still reaches it as ``http.disconnect``), the scope carries the guard's
``x-request-id``, and every response message passes through unbuffered while the admission
observes it (status, content type, first token, inter-token gaps, ``usage``, ``finish_reason``,
end of stream). The guard adds ``x-kvguard-queue-ms``, ``x-kvguard-max-tokens`` (the value it
filled in for a request sent without ``max_tokens``) and, unless the app set one,
``x-request-id`` to the response headers. The admission is finished exactly once: with its
natural outcome when the app returns, ``canceled`` or ``failed`` when it raises (re-raised).

The per-request state lives in one :class:`Relay` object: before the decision it reads the
body and makes the disconnect watch the controller is given, after it its bound
``receive``/``send`` are handed to the app (no closures built per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from guard.admission.admitted import Admitted
from guard.request.body import read_body
from guard.request.request_ids import GUARD_REQUEST_ID_HEADER, MAX_TOKENS_HEADER

__all__ = ["Relay", "forward_scope", "start_with_headers", "REQUEST_ID_HEADER"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
_QUEUE_MS_HEADER = b"x-kvguard-queue-ms"


def forward_scope(scope: Scope, request_id: bytes, body_len: int | None = None) -> Scope:
    """A copy of ``scope`` whose ``x-request-id`` header is the guard's (and whose
    ``content-length`` is ``body_len`` when the guard rewrote the body)."""
    headers = []
    if body_len is None:
        for header in scope["headers"]:
            if header[0] != REQUEST_ID_HEADER:
                headers.append(header)
    else:
        for header in scope["headers"]:
            if header[0] != REQUEST_ID_HEADER and header[0] != b"content-length":
                headers.append(header)
    headers.append((REQUEST_ID_HEADER, request_id))
    if body_len is not None:
        headers.append((b"content-length", str(body_len).encode()))
    inner = scope.copy()
    inner["headers"] = headers
    return inner


def start_with_headers(message: Message, ticket: Any, request_id: bytes,
                       queue_ms: bytes, client_id: str | None = None) -> Message:
    """Note the status and content type; add the guard's headers (ASGI names are lower-case):
    ``x-kvguard-request-id`` (the guard's id) and, unless the app set its own, ``x-request-id``
    (``client_id``, the client's sane one, else the guard's; the app's echo of the guard's id
    gives way to the client's)."""
    headers = list(message.get("headers", ()))
    content_type = b""
    has_request_id = False
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == REQUEST_ID_HEADER:
            has_request_id = value != request_id or client_id is None
    if client_id is not None and not has_request_id:  # the echo of the guard's id goes
        headers = [h for h in headers if h[0] != REQUEST_ID_HEADER]
        request_id = client_id.encode()
    ticket.on_start(message["status"], content_type)
    headers.append((GUARD_REQUEST_ID_HEADER, ticket.cost.request_id.encode()))
    headers.append((_QUEUE_MS_HEADER, queue_ms))
    priced = ticket.priced
    if priced is not None and priced.max_tokens_defaulted:  # the client sent no max_tokens
        headers.append((MAX_TOKENS_HEADER, str(ticket.cost.max_tokens).encode()))
    if not has_request_id:
        headers.append((REQUEST_ID_HEADER, request_id))
    started = message.copy()
    started["headers"] = headers
    return started


class Relay:
    """One request's ASGI side: the body reader and the disconnect watch before the decision,
    then (once admitted) the receive/send pair the wrapped app sees."""

    __slots__ = ("admission", "ticket", "request_id", "_receive", "_send", "_first", "gone",
                 "read_body", "_clock", "_itl")

    def __init__(self, receive: Receive, send: Send, max_bytes: int,
                 content_length: int | None) -> None:
        self.admission: Admitted | None = None
        self.ticket: Any = None  # the admitted request's ticket, reported to per message
        self.request_id = b""
        self._clock: Callable[[], float] | None = None
        self._itl: Any = None
        self._receive = receive
        self._send = send
        self._first: Message | None = None
        self.gone: asyncio.Future | None = None  # the disconnect watch, made while queued
        # read_body() -> the whole body under the limit
        self.read_body: Callable[[], Awaitable[bytes]] = partial(read_body, receive, max_bytes,
                                                                 content_length)

    # --- before the decision: the request's body and disconnect watch -----------------------

    def client_gone(self) -> asyncio.Future:
        """A task that ends with the client's ``http.disconnect`` message (made once)."""
        if self.gone is None:
            self.gone = asyncio.ensure_future(_until_disconnect(self._receive))
        return self.gone

    # --- after admission: what the wrapped app calls -----------------------------------------
    async def receive(self) -> Message:
        first = self._first
        if first is not None:
            self._first = None
            return first
        gone = self.gone
        if gone is not None:
            self.gone = None
            message = await gone
        else:
            message = await self._receive()
        if message["type"] == "http.disconnect":
            self.ticket.on_disconnect()
        return message

    async def send(self, message: Message) -> None:
        """Each response message to the client, shown to the ticket first (status, first token,
        gaps, usage, end): what ``Admitted.on_start`` / ``on_body`` do, for every chunk."""
        kind = message["type"]
        ticket = self.ticket
        if kind == "http.response.body":
            gap_s = ticket.on_body(message.get("body", b""), message.get("more_body", False),
                                   self._clock())
            if gap_s is not None:
                self._itl.observe(gap_s)
        elif kind == "http.response.start":
            queue_ms = (ticket.dispatch_s - ticket.cost.arrival_s) * 1000.0
            message = start_with_headers(message, ticket, self.request_id,
                                         f"{queue_ms:.1f}".encode(),
                                         self.admission.client_request_id)
        try:
            await self._send(message)
        except OSError:
            ticket.on_disconnect()
            raise
        if ticket.chunks_s is not None and kind == "http.response.body":  # traced only
            self.admission.on_forwarded()

    def stop_watching(self) -> None:
        gone = self.gone
        if gone is not None and not gone.done():
            gone.cancel()

    async def run(self, app: Callable, scope: Scope, admission: Admitted) -> None:
        """Run the wrapped app for the admitted request; finish the admission exactly once."""
        self.admission = admission
        self.ticket = ticket = admission.ticket
        self._clock, self._itl = admission.clock, admission.itl
        body = admission.body
        self.request_id = ticket.cost.request_id.encode()
        self._first = {"type": "http.request", "body": body, "more_body": False}
        ticket.num_request_bytes = len(body)
        body_len = len(body) if admission.body_rewritten else None
        try:
            await app(forward_scope(scope, self.request_id, body_len), self.receive, self.send)
        except BaseException as exc:
            admission.finish(exc)
            raise
        finally:
            gone = self.gone
            if gone is not None and not gone.done():
                gone.cancel()
        ticket.release(ticket.natural_outcome())  # what admission.finish() does, no error


async def _until_disconnect(receive: Receive) -> Message:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return message
