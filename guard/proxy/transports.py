"""Pooled keep-alive HTTP clients to the upstream replicas, behind one small interface.

Three implementations of :class:`Transport`, chosen by the proxy's ``upstream_client`` key:
``h1`` (the default: HTTP/1.1 on raw asyncio protocols, :mod:`guard.proxy.h1_transport`),
``aiohttp`` and ``httpx``; ``kvguard bench proxy --stacks`` compares them.
Each keeps one connection pool for all upstreams with keep-alive, never decompresses (bytes
pass through as the upstream sent them) and maps its own exceptions onto one tree::

    UpstreamError
     ├── UpstreamUnreachable  nothing usable came back: connect refused / timed out, the
     │                        connection closed or the status line was garbage before any
     │                        response (safe to re-dispatch: nothing reached the client)
     ├── UpstreamTimeout      no byte within read_timeout_s (the response head or the next chunk)
     └── UpstreamBroken       the response began and was cut (reset, truncated body)

:meth:`Transport.send` returns an :class:`UpstreamResponse` once the status line and headers
are in; its ``chunks()`` yields body bytes as they arrive; ``aclose()`` returns a fully read
connection to the pool and aborts (closes) one that is not, which is how the upstream learns
that the client went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import httpx

__all__ = [
    "Transport", "UpstreamResponse", "UpstreamError", "UpstreamUnreachable", "UpstreamTimeout",
    "UpstreamBroken", "AiohttpTransport", "HttpxTransport", "make_transport", "UPSTREAM_CLIENTS",
    "HOP_BY_HOP",
]

UPSTREAM_CLIENTS = ("aiohttp", "httpx", "h1")
Headers = list[tuple[bytes, bytes]]
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-connection",
                        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade", b"host", b"content-length"})
# Idle pooled connections are dropped before uvicorn's default 5 s keep-alive would close them
# under us (a request sent on a connection the server is closing fails before any byte).
_KEEPALIVE_S = 4.0
# the proxy's own server writes these on every response
_SERVER_WRITTEN = HOP_BY_HOP | {b"date", b"server"}


class UpstreamError(Exception):
    """An upstream request failed; see the module docstring for the tree."""


class UpstreamUnreachable(UpstreamError):
    """Failed before any response: nothing reached the client, re-dispatch is safe."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for ``read_timeout_s``."""


class UpstreamBroken(UpstreamError):
    """The response started and was cut."""


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

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET (models, probes): status and body. Raises :class:`UpstreamError`."""
        ...

    async def aclose(self) -> None: ...


def _end_to_end(raw: Any) -> Headers:
    out = []
    for name, value in raw:
        name = name.lower()
        if name not in _SERVER_WRITTEN:
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
        self.headers = _end_to_end(response.raw_headers)
        self._done = False

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
                                             keepalive_timeout=_KEEPALIVE_S)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                            sock_read=self._read_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
        return self._session

    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        try:
            response = await self._client().post(url, data=body, headers=_str_headers(headers),
                                                 allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamUnreachable(f"connect to {url} timed out ({exc!r})") from None
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"{url} sent no response within "
                                  f"{self._read_timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"{url}: {exc!r}") from None
        return _AiohttpResponse(response)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with self._client().get(url, allow_redirects=False,
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


# --- httpx ---------------------------------------------------------------------------------
class _HttpxResponse:
    __slots__ = ("status", "headers", "_response")
    ended = False

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = _end_to_end(response.headers.raw)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                if chunk:
                    yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"no response bytes within the read timeout ({exc!r})") from None
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"the upstream response was cut: {exc!r}") from None

    async def aclose(self) -> None:
        await self._response.aclose()  # closes the connection unless the body was read


class HttpxTransport:
    """httpx ``AsyncClient`` with one pool (httpx caps connections in total only: the per-replica
    cap times the number of replicas)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 max_connections_per_replica: int, num_replicas: int) -> None:
        self._read_timeout_s = read_timeout_s
        max_connections = max_connections_per_replica * num_replicas
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections,
                                keepalive_expiry=_KEEPALIVE_S),
            trust_env=False, follow_redirects=False)

    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        request = self._client.build_request("POST", url, headers=_str_headers(headers),
                                             content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            raise UpstreamUnreachable(f"connect to {url} timed out ({exc!r})") from None
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"{url} sent no response within "
                                  f"{self._read_timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"{url}: {exc!r}") from None
        return _HttpxResponse(response)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            response = await self._client.get(url, timeout=timeout_s)
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"GET {url} timed out after {timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"GET {url}: {exc!r}") from None
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._client.aclose()


def make_transport(name: str, connect_timeout_s: float, read_timeout_s: float,
                   max_connections_per_replica: int, num_replicas: int) -> Transport:
    if name == "aiohttp":
        return AiohttpTransport(connect_timeout_s, read_timeout_s, max_connections_per_replica,
                                num_replicas)
    if name == "httpx":
        return HttpxTransport(connect_timeout_s, read_timeout_s, max_connections_per_replica,
                              num_replicas)
    if name == "h1":
        from guard.proxy.h1_transport import H1Transport  # it imports this module's names

        return H1Transport(connect_timeout_s, read_timeout_s, max_connections_per_replica,
                           num_replicas)
    raise ValueError(f"upstream_client: must be one of {UPSTREAM_CLIENTS}, got {name!r}")
