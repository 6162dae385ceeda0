"""What the proxy's ASGI path needs per request beside the admission: the body reader and
disconnect watch (:class:`AsgiExchange`), the upstream request's headers, a JSON answer.

:class:`AsgiExchange` reads the body the way the serving server offers it: kvguard's own server
hands over a body it already holds and a disconnect future (``kvguard.body`` and
``kvguard.disconnect`` scope extensions: no task per request); any other server gets the ASGI
``receive`` loop, under the byte limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from guard.errors import BodyTooLarge
from guard.proxy.h1_message import NOT_FORWARDED
from guard.relay import REQUEST_ID_HEADER
from guard.request.body import read_body

__all__ = ["AsgiExchange", "send_json", "upstream_headers"]

Message = dict[str, Any]
RawHeaders = list[tuple[bytes, bytes]]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def upstream_headers(raw_headers: RawHeaders, request_id: str,
                     not_forwarded: frozenset[bytes] = NOT_FORWARDED) -> RawHeaders:
    """The client's end-to-end headers (less ``not_forwarded``) with the guard's
    ``x-request-id`` (the body may have been rewritten, so its length is the transport's to
    set)."""
    headers = []
    for name, value in raw_headers:
        if name not in not_forwarded:
            headers.append((name, value))
    headers.append((REQUEST_ID_HEADER, request_id.encode()))
    return headers


class AsgiExchange:
    """One request's body reader and disconnect watch (what its AdmissionRequest is made of)."""

    __slots__ = ("_receive", "_max_bytes", "_content_length", "gone", "_server_gone", "writer",
                 "_take_body")

    def __init__(self, receive: Receive, max_bytes: int, declared: int | None,
                 extensions: dict | None = None) -> None:
        self._receive = receive
        self._max_bytes = max_bytes
        self._content_length = declared
        self.gone: asyncio.Future | None = None
        # kvguard's server says when the client left (serving.h1_exchange): no task per request
        watch = extensions.get("kvguard.disconnect") if extensions else None
        self._server_gone = watch["future"] if watch else None
        body = extensions.get("kvguard.body") if extensions else None
        self.writer = (body["write"], body["drain"]) if body else None  # chunks without a task
        self._take_body = body.get("take") if body else None  # the body, when all arrived

    def read_body(self) -> bytes | Awaitable[bytes]:
        """The body itself when the server already holds all of it; else an awaitable of it,
        read under the byte limit."""
        take, limit = self._take_body, self._max_bytes
        if take is not None and (self._content_length or 0) <= limit:
            body = take()
            if body is not None:
                if len(body) > limit:  # chunked: no length declared
                    raise BodyTooLarge(limit)
                return body
        return read_body(self._receive, limit, self._content_length)

    def client_gone(self) -> asyncio.Future:
        """Completes with the client's ``http.disconnect`` (made on first use)."""
        if self.gone is None:
            if self._server_gone is not None:
                self.gone = self._server_gone()
            else:
                self.gone = asyncio.ensure_future(_until_disconnect(self._receive))
        return self.gone

    def stop(self) -> None:
        if self.gone is not None and not self.gone.done() and self._server_gone is None:
            self.gone.cancel()  # the watch task (the server's future is the server's)


async def _until_disconnect(receive: Receive) -> Message:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return message


async def send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
