"""The proxy's upstream clients, chosen by its ``upstream_client`` key: ``h1`` (the default:
HTTP/1.1 on raw asyncio protocols, :mod:`guard.proxy.h1_transport`) and ``aiohttp`` (the library
fallback, :class:`AiohttpTransport`); ``kvguard bench proxy --stacks`` compares them. Both keep
one keep-alive pool for all upstreams, never decompress (bytes pass through as the upstream
sent them), send the request target exactly as given and map their exceptions onto the tree
of :mod:`guard.proxy.upstream_contract` (re-exported here).

aiohttp parses responses leniently (outside Python's dev mode it reads a bare LF as a line end,
as RFC 9112 §2.2 lets a recipient do; the h1 client refuses it); what it hands back is checked
here as the h1 client checks its own: every field name a token, no control character but HTAB
in a value, at most 128 fields (aiohttp's own cap), else :class:`UpstreamMalformed`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from yarl import URL

from guard.proxy.h1_transport import H1Transport
from guard.proxy.upstream_contract import (
    HOP_BY_HOP,
    KEEPALIVE_S,
    SERVER_WRITTEN,
    Headers,
    Transport,
    UpstreamBroken,
    UpstreamError,
    UpstreamMalformed,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = [
    "Transport", "UpstreamResponse", "UpstreamError", "UpstreamUnreachable", "UpstreamTimeout",
    "UpstreamBroken", "UpstreamMalformed", "AiohttpTransport", "make_transport",
    "UPSTREAM_CLIENTS", "HOP_BY_HOP",
]

UPSTREAM_CLIENTS = ("h1", "aiohttp")
_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")


def _end_to_end(raw: Any) -> Headers:
    """The response's end-to-end fields, names lower-cased; :class:`UpstreamMalformed` when
    one is not a valid field."""
    out = []
    for name, value in raw:
        if _NAME.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            raise UpstreamMalformed(f"invalid response header field {name[:40]!r}")
        name = name.lower()
        if name not in SERVER_WRITTEN:
            out.append((name, value))
    return out


def _str_headers(headers: Headers) -> list[tuple[str, str]]:
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers
            if n.lower() not in HOP_BY_HOP]


# --- aiohttp -------------------------------------------------------------------------------
class _AiohttpResponse:
    __slots__ = ("status", "headers", "_response", "_done")
    ended = False

    def __init__(self, response: Any) -> None:
        self._response = response
        self.status = response.status
        self._done = False
        self.headers = _end_to_end(response.raw_headers)

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    self._done = True
                    return
                yield chunk
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"no response bytes within the read timeout ({exc!r})") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamBroken(f"the upstream response was cut: {exc!r}") from None

    async def aclose(self) -> None:
        if self._done:
            self._response.release()
        else:
            self._response.close()  # abort: the upstream sees the connection close


class AiohttpTransport:
    """aiohttp ``ClientSession`` with one ``TCPConnector`` pool (created on first use, on the
    serving loop)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 max_connections_per_replica: int, num_replicas: int) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._per_replica = max_connections_per_replica
        self._session: Any = None

    def _client(self) -> Any:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._per_replica,
                                             keepalive_timeout=KEEPALIVE_S)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                            sock_read=self._read_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
        return self._session

    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        # encoded=True: the target goes out byte for byte as given (yarl would re-quote it)
        try:
            response = await self._client().post(URL(url, encoded=True), data=body,
                                                 headers=_str_headers(headers),
                                                 allow_redirects=False)
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
            raise UpstreamUnreachable(f"connect to {url}: {exc!r}") from None
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"{url} sent no response within "
                                  f"{self._read_timeout_s:g} s") from None
        except aiohttp.ClientResponseError as exc:  # aiohttp's parser refused the response
            raise UpstreamMalformed(f"{url} sent an invalid response: {exc!r}") from None
        except (aiohttp.ClientError, OSError) as exc:  # after the request went out: not re-sent
            raise UpstreamBroken(f"{url}: {exc!r}") from None
        try:
            return _AiohttpResponse(response)
        except UpstreamMalformed:
            response.close()  # the connection is not trusted again
            raise

    async def get(self, url: str, timeout_s: float,
                  headers: Headers | None = None) -> tuple[int, bytes]:
        try:
            fields = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers or ()}
            async with self._client().get(url, allow_redirects=False, headers=fields,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.read()
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"GET {url} timed out after {timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"GET {url}: {exc!r}") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_transport(name: str, connect_timeout_s: float, read_timeout_s: float,
                   max_connections_per_replica: int, num_replicas: int) -> Transport:
    """The ``upstream_client`` named ``name`` (one of :data:`UPSTREAM_CLIENTS`)."""
    if name == "aiohttp":
        return AiohttpTransport(connect_timeout_s, read_timeout_s, max_connections_per_replica,
                                num_replicas)
    if name == "h1":
        return H1Transport(connect_timeout_s, read_timeout_s, max_connections_per_replica,
                           num_replicas)
    raise ValueError(f"upstream_client: must be one of {UPSTREAM_CLIENTS}, got {name!r}")
