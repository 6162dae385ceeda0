"""Relaying one admitted request through the wrapped ASGI app, watching its response stream.

:func:`relay` runs the wrapped ASGI app for an :class:`~guard.admission.Admission`: the app gets
the admission's body as its first ``http.request`` (then the client's own later messages, so a
disconnect still reaches it as ``http.disconnect``), the scope carries the guard's
``x-request-id``, and every response message passes through unbuffered while the admission
observes it (status, content type, first token, inter-token gaps, ``usage``, ``finish_reason``,
end of stream). The guard adds ``x-kvguard-queue-ms`` and, unless the app set one,
``x-request-id`` to the response headers. The admission is finished exactly once: with its
natural outcome when the app returns, ``canceled`` or ``failed`` when it raises (re-raised).

The per-request state lives in one :class:`Relay` object whose bound ``receive``/``send`` are
handed to the app (no closures built per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from guard.admission import Admission

__all__ = ["Relay", "relay", "forward_scope", "start_with_headers", "REQUEST_ID_HEADER"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
_QUEUE_MS_HEADER = b"x-kvguard-queue-ms"


def forward_scope(scope: Scope, request_id: bytes, body_len: int | None = None) -> Scope:
    """A copy of ``scope`` whose ``x-request-id`` header is the guard's (and whose
    ``content-length`` is ``body_len`` when the guard rewrote the body)."""
    headers = []  # a plain loop: a comprehension is one more call per request
    for header in scope["headers"]:
        name = header[0]
        if name != REQUEST_ID_HEADER and (body_len is None or name != b"content-length"):
            headers.append(header)
    headers.append((REQUEST_ID_HEADER, request_id))
    if body_len is not None:
        headers.append((b"content-length", str(body_len).encode()))
    inner = scope.copy()
    inner["headers"] = headers
    return inner


def start_with_headers(message: Message, admission: Admission, request_id: bytes,
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
    admission.on_start(message["status"], content_type)
    headers.append((_QUEUE_MS_HEADER, queue_ms))
    if not has_request_id:
        headers.append((REQUEST_ID_HEADER, request_id))
    started = message.copy()
    started["headers"] = headers
    return started


class Relay:
    """The receive/send pair the wrapped app sees for one admitted request."""

    __slots__ = ("admission", "request_id", "_receive", "_send", "_first", "_gone")

    def __init__(self, admission: Admission, receive: Receive, send: Send,
                 gone: asyncio.Future | None) -> None:
        self.admission = admission
        self.request_id = admission.request_id.encode()
        self._receive = receive
        self._send = send
        self._first: Message | None = {"type": "http.request", "body": admission.body,
                                       "more_body": False}
        self._gone = gone  # the disconnect watch started while the request was queued

    async def receive(self) -> Message:
        first = self._first
        if first is not None:
            self._first = None
            return first
        gone = self._gone
        if gone is not None:
            self._gone = None
            message = await gone
        else:
            message = await self._receive()
        if message["type"] == "http.disconnect":
            self.admission.on_disconnect()
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            self.admission.on_body(message.get("body", b""), message.get("more_body", False))
        elif kind == "http.response.start":
            message = start_with_headers(message, self.admission, self.request_id,
                                         f"{self.admission.queue_ms:.1f}".encode())
        try:
            await self._send(message)
        except OSError:
            self.admission.on_disconnect()
            raise
        if kind == "http.response.body":
            self.admission.on_forwarded()

    def cancel_gone(self) -> None:
        gone = self._gone
        if gone is not None and not gone.done():
            gone.cancel()


async def relay(app: Callable, scope: Scope, receive: Receive, send: Send, admission: Admission,
                gone: asyncio.Future | None = None) -> None:
    """Run the wrapped app for an admitted request; finish the admission exactly once."""
    state = Relay(admission, receive, send, gone)
    body_len = len(admission.body) if admission.body_rewritten else None
    try:
        await app(forward_scope(scope, state.request_id, body_len), state.receive, state.send)
    except BaseException as exc:
        admission.finish(exc)
        raise
    finally:
        state.cancel_gone()
    admission.finish()
