"""What every upstream client of the proxy shares: the :class:`Transport` interface, its
exception tree and the header sets. Imports no other proxy module, so the clients
(:mod:`guard.proxy.transports`, :mod:`guard.proxy.h1_transport` and its parts) all import it
and never each other in a circle.

Every client maps its own failures onto one tree::

    UpstreamError
     ├── UpstreamUnreachable  the request never reached the upstream: connect refused or timed
     │                        out, or a pooled connection found closed before the request was
     │                        written (safe to re-dispatch: nothing was sent, nothing answered)
     ├── UpstreamTimeout      read_timeout_s of silence (no byte of the head or of the body)
     └── UpstreamBroken       the request was written and the exchange broke: the connection
         │                    closed before or during the response, or the body was cut. Never
         │                    re-sent (RFC 9110 §9.2.2: the upstream may have acted on it)
         └── UpstreamMalformed  the upstream's bytes are not a valid HTTP/1.1 response (a bad
                              status line or header field, a bare LF, a framing kvguard does not
                              read, too many or too large header fields): 502, not re-sent, and
                              not held against the replica's health (one odd response is not a
                              dead replica, and must not let a client eject a healthy one)

:meth:`Transport.send` returns an :class:`UpstreamResponse` once the status line and headers
are in; its ``chunks()`` yields body bytes as they arrive; ``aclose()`` returns a fully read
connection to the pool and aborts (closes) one that is not, which is how the upstream learns
that the client went away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

__all__ = [
    "Transport", "UpstreamResponse", "UpstreamError", "UpstreamUnreachable", "UpstreamTimeout",
    "UpstreamBroken", "UpstreamMalformed", "Headers", "HOP_BY_HOP", "SERVER_WRITTEN",
    "KEEPALIVE_S",
]

Headers = list[tuple[bytes, bytes]]
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-connection",
                        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade", b"host", b"content-length"})
# the proxy's own server writes these on every response
SERVER_WRITTEN = HOP_BY_HOP | {b"date", b"server"}
# Idle pooled connections are dropped before uvicorn's default 5 s keep-alive would close them
# under us (a request sent on a connection the server is closing fails before any byte).
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """An upstream request failed; see the module docstring for the tree."""


class UpstreamUnreachable(UpstreamError):
    """The request never reached the upstream: re-dispatch is safe."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for ``read_timeout_s``."""


class UpstreamBroken(UpstreamError):
    """The request was written and no complete response came back (never re-sent)."""


class UpstreamMalformed(UpstreamBroken):
    """The upstream's response is not valid HTTP/1.1 (502; not a health failure)."""


class UpstreamResponse(Protocol):
    status: int
    headers: Headers  # hop-by-hop headers removed (content-length too: the server re-frames)
    # read after each chunk: True when that chunk was the body's last (the relay then sends it
    # with the end of the response, one write instead of two); a client that cannot tell says
    # False and the body ends with the empty chunk after the last
    ended: bool

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        """POST ``body`` to ``url``; raises :class:`UpstreamError` subclasses only."""
        ...

    async def get(self, url: str, timeout_s: float,
                  headers: Headers | None = None) -> tuple[int, bytes]:
        """A small GET (models, probes) with ``headers`` (e.g. the replica's own
        ``Authorization``): status and body. Raises :class:`UpstreamError`."""
        ...

    async def aclose(self) -> None: ...
