"""``AdmissionRequest``: what an adapter hands :meth:`AdmissionController.decide` per request.

The adapter builds it from what its front end parsed: the request path (normalised by the front
end), the headers (lower-case names), the whole body, the tenant's API key (from
``Authorization: Bearer``), and how to learn that the client left. A body that could not be
read is carried as the error that stopped it (:attr:`AdmissionRequest.unread`), so the
controller answers it and counts it like any other request: a 401 still comes before a 413,
and a client that left while sending its body is counted canceled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from guard.errors import ClientDisconnected, PricingError

__all__ = ["AdmissionRequest", "ClientGone", "bearer_token", "read_request"]

# returns one future (the same on every call, made on first use) that completes when the
# client disconnects; the controller only watches it, never consumes it
ClientGone = Callable[[], asyncio.Future]


class AdmissionRequest:
    """One request to admit, as its adapter saw it."""

    __slots__ = ("path", "headers", "body", "client_gone", "api_key", "unread")

    def __init__(self, path: str, headers: Mapping[str, str], body: bytes,
                 client_gone: ClientGone | None = None,
                 unread: PricingError | ClientDisconnected | None = None) -> None:
        self.path = path  # which paths are admitted is the adapter's call (is_admitted_path)
        self.headers = headers
        self.body = body  # the whole body (b"" when unread)
        self.client_gone = client_gone
        self.api_key = bearer_token(headers.get("authorization"))  # the tenant's key
        self.unread = unread  # why the body could not be read (413, the client left), or None


async def read_request(path: str, headers: Mapping[str, str],
                       read_body: Callable[[], bytes | Awaitable[bytes]],
                       client_gone: ClientGone | None = None) -> AdmissionRequest:
    """The request with its whole body (``read_body()``: the body, or an awaitable of it),
    or with the error that stopped reading it."""
    try:
        body = read_body()
        if not isinstance(body, bytes):
            body = await body
    except (PricingError, ClientDisconnected) as error:
        return AdmissionRequest(path, headers, b"", client_gone, error)
    return AdmissionRequest(path, headers, body, client_gone)


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
