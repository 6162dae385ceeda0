"""Reading an ASGI request: the body under a byte limit, and the headers as a dict."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from guard.errors import BodyTooLarge, ClientDisconnected

__all__ = ["content_length", "headers_from_pairs", "headers_from_scope", "read_body"]

Receive = Callable[[], Awaitable[dict]]


async def read_body(receive: Receive, max_bytes: int, content_length: int | None = None) -> bytes:
    """The whole ASGI request body; BodyTooLarge as soon as it passes ``max_bytes``.

    A declared ``content_length`` over the limit is refused before anything is read.
    """
    if content_length is not None and content_length > max_bytes:
        raise BodyTooLarge(max_bytes)
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def headers_from_scope(scope: Mapping[str, Any]) -> dict[str, str]:
    """ASGI ``scope["headers"]`` as a dict of lower-case names (last value wins)."""
    headers = {}
    for name, value in scope.get("headers", ()):
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")
    return headers


def headers_from_pairs(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """``(name, value)`` byte pairs as a dict of lower-case names (last value wins)."""
    headers = {}  # a plain loop: a comprehension is one more call per request
    for name, value in pairs:
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")
    return headers


def content_length(headers: Mapping[str, str]) -> int | None:
    """The declared ``content-length``, or None when absent or not a number (at most 18 ASCII
    digits: a longer one is no length a body can have, and ``int`` refuses 4,301+ digits)."""
    value = headers.get("content-length")
    if value is None or len(value) > 18 or not (value.isascii() and value.isdigit()):
        return None
    return int(value)
