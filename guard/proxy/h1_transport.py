"""``upstream_client = "h1"``: the proxy's upstream :class:`~guard.proxy.upstream_contract.Transport`
on raw asyncio protocols (``loop.create_connection`` and an :class:`asyncio.Protocol` per
connection; messages in :mod:`guard.proxy.h1_message`).

* **Pool** per ``(host, port)``: keep-alive connections, at most ``max_connections_per_replica``
  open to one replica (more requests wait for one), the most recently used taken first; a
  connection goes back only once its response was read to the end and handed on, with reading
  not paused (``Connection.reusable``), and an idle one is closed ``keepalive_s`` after its last
  response (before the upstream's own keep-alive would close it under a request).
* **Never sent twice** (RFC 9110 §9.2.2): only a pooled connection found closed before the
  request was written on it is replaced by a fresh one; once written, a close before or inside
  the response is :class:`UpstreamBroken`, a response that is not valid HTTP/1.1
  :class:`UpstreamMalformed` (at once: a bare LF or a bad field does not wait for a timeout).
* **Timeouts**: ``connect_timeout_s`` on connect (:class:`UpstreamUnreachable`),
  ``read_timeout_s`` of silence (since the last byte) while the head or the next body bytes
  are waited for (:class:`UpstreamTimeout`).
* **The request line** carries the URL's target exactly as given; a URL whose target has a
  byte outside the request-target grammar is refused (:class:`UpstreamUnreachable`) and never
  written.
* **Bodies** (``content-length``, chunked — de-chunked here — or until close) are handed on as
  they arrive: one :meth:`chunks` item per read from the socket (what arrived while the consumer
  was busy is joined into the next item). Past ``HIGH_WATER_BYTES`` not yet taken, reading from
  the upstream pauses until the consumer takes them (:mod:`guard.proxy.h1_connection`).
* :meth:`aclose` on a response whose body is not all in closes its connection at once (the
  upstream sees its client go and frees the request's KV).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable
from urllib.parse import urlsplit

from guard.proxy.h1_connection import DONE, IDLE, Connection, Stale
from guard.proxy.h1_message import ResponseHead, proxied_request, request_head
from guard.proxy.upstream_contract import KEEPALIVE_S, Headers, UpstreamTimeout, UpstreamUnreachable
from guard.request.target import is_request_target
from guard.self_connect import connected_to_itself, drop

__all__ = ["H1Transport"]

_MAX_TARGETS = 1024  # parsed URLs kept (replicas x routes: a handful in practice)


class _Pool:
    """The connections to one ``(host, port)``."""

    __slots__ = ("key", "host", "port", "ssl", "idle", "num_open", "waiters", "sweep")

    def __init__(self, key: tuple[str, str, int], ssl_context: ssl.SSLContext | None) -> None:
        self.key = key
        _, self.host, self.port = key
        self.ssl = ssl_context
        self.idle: list[Connection] = []  # oldest first
        self.num_open = 0  # idle, busy and connecting
        self.waiters: deque[asyncio.Future] = deque()
        self.sweep: asyncio.TimerHandle | None = None

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def forget(self, conn: Connection) -> None:
        """``conn`` is closed: its slot is free."""
        self.num_open -= 1
        if conn.phase == IDLE:
            self.idle.remove(conn)
        self.wake_one()


class _Response:
    """:class:`~guard.proxy.upstream_contract.UpstreamResponse` over one :class:`Connection`."""

    __slots__ = ("status", "headers", "_conn", "_closed", "_owner")

    def __init__(self, owner: H1Transport, conn: Connection, head: ResponseHead) -> None:
        self._owner = owner
        self._conn = conn
        self.status = head.status
        self.headers = head.headers
        self._closed = False

    async def chunks(self):
        next_body = self._conn.next_body
        while (data := await next_body()) is not None:
            yield data

    async def push(self, sink) -> bool:
        """:meth:`Connection.push_body`: ``sink(data, last)`` per read, from the protocol."""
        return await self._conn.push_body(sink)

    def stop_push(self) -> None:
        self._conn.stop_push()

    @property
    def ended(self) -> bool:
        """The body is in whole and every byte of it was taken (by the last ``chunks`` item)."""
        return self._conn.body_taken

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.reusable:
            self._owner.release(conn)
        else:
            conn.close()


class H1Transport:
    """Pooled HTTP/1.1 client on asyncio protocols (created idle; pools made on first use)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 max_connections_per_replica: int, num_replicas: int = 1, *,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections_per_replica = max_connections_per_replica
        self.keepalive_s = keepalive_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._targets: dict[str, tuple[_Pool, bytes, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def send(self, url: str, headers: Headers, body: bytes) -> _Response:
        return await self._exchange(url, b"POST", headers, body)

    async def get(self, url: str, timeout_s: float,
                  headers: Headers | None = None) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._exchange(url, b"GET", list(headers or ()), None)
                try:
                    body = b"".join([chunk async for chunk in response.chunks()])
                finally:
                    await response.aclose()
        except TimeoutError:
            raise UpstreamTimeout(f"GET {url} timed out after {timeout_s:g} s") from None
        return response.status, body

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        self._targets = {}
        self.loop = None
        for pool in pools.values():
            if pool.sweep is not None:
                pool.sweep.cancel()
            for conn in list(pool.idle):
                conn.close()
            while pool.waiters:
                waiter = pool.waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(UpstreamUnreachable("the upstream client was closed"))

    # --- exchanges -----------------------------------------------------------------------
    def send_now(self, url: str, headers: Headers, body: bytes,
                 request_id: str | None = None) -> Awaitable[_Response] | None:
        """:meth:`send`, the request written at once when an idle pooled connection can take
        it (from a protocol callback too: no task needed): an awaitable of the response, to
        be awaited (it owns the connection until then). None when no connection is idle or
        the URL is unusable; :meth:`send` then does it all, errors included. ``request_id``:
        ``headers`` are a client's as kvguard's server parsed them, forwarded with that
        ``x-request-id`` (:func:`~guard.proxy.h1_message.proxied_request`, one pass)."""
        try:
            pool, target, host = self._target(url)
        except UpstreamUnreachable:
            return None
        if not pool.idle:
            return None
        conn = self._pop_idle(pool)
        if conn is None:
            return None
        if request_id is None:
            request = self._request(b"POST", target, host, headers, body)
        else:
            request = proxied_request(target, host, headers, request_id, body)
        conn.start(request)
        return self._response(pool, request, conn)

    async def _exchange(self, url: str, method: bytes, headers: Headers,
                        body: bytes | None) -> _Response:
        pool, target, host = self._target(url)
        request = self._request(method, target, host, headers, body)
        conn = await self._acquire(pool, False)
        conn.start(request)
        return await self._response(pool, request, conn)

    @staticmethod
    def _request(method: bytes, target: bytes, host: bytes, headers: Headers,
                 body: bytes | None) -> bytes:
        request = request_head(method, target, host, headers, None if body is None else len(body))
        return request + body if body else request

    async def _response(self, pool: _Pool, request: bytes, conn: Connection) -> _Response:
        """The response head to ``request``, already written on ``conn``; a pooled connection
        found closed before the request was written is replaced by a fresh one, once."""
        fresh = False
        while True:
            try:
                head = await conn.read_head()
            except Stale as exc:
                conn.close()
                if not fresh:
                    fresh = True  # nothing was written: the request goes on a fresh one
                    conn = await self._acquire(pool, fresh)
                    conn.start(request)
                    continue
                raise UpstreamUnreachable(str(exc)) from None
            except BaseException:
                conn.close()
                raise
            return _Response(self, conn, head)

    def _target(self, url: str) -> tuple[_Pool, bytes, bytes]:
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamUnreachable(f"{url}: not an http:// or https:// URL")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise UpstreamUnreachable(f"{url}: {exc}") from None
        key = (parts.scheme, parts.hostname, port)
        pool = self._pools.get(key)
        if pool is None:
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
            pool = self._pools[key] = _Pool(key, self._ssl_context()
                                            if parts.scheme == "https" else None)
        target = ((parts.path or "/") + (f"?{parts.query}" if parts.query else "")).encode(
            "utf-8", "surrogateescape")
        if not is_request_target(target):
            raise UpstreamUnreachable(f"{url[:200]!r}: not a valid request target")
        host = parts.netloc.rpartition("@")[2]
        known = (pool, target, host.encode("latin-1"))
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = known
        return known

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    # --- the pool ------------------------------------------------------------------------
    async def _acquire(self, pool: _Pool, fresh: bool) -> Connection:
        while True:
            if pool.idle:
                if not fresh:
                    conn = self._pop_idle(pool)
                    if conn is not None:
                        return conn
                elif pool.num_open >= self.max_connections_per_replica:
                    pool.idle[0].close()  # make room for the fresh one
            if pool.num_open < self.max_connections_per_replica:
                pool.num_open += 1
                try:
                    return await self._connect(pool)
                except BaseException:
                    pool.num_open -= 1
                    pool.wake_one()
                    raise
            waiter = self.loop.create_future()
            pool.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    pool.wake_one()  # woken and cancelled at once: pass the turn on
                raise

    def _pop_idle(self, pool: _Pool) -> Connection | None:
        """The most recently used idle connection; None when it expired (it and every older
        one close), is closing or has its upstream's close waiting unread."""
        conn = pool.idle.pop()
        conn.phase = DONE
        if conn.transport.is_closing() or conn.peer_spoke():
            conn.close()
            return None
        if self.loop.time() - conn.idle_since_s < self.keepalive_s:
            return conn
        conn.close()
        for old in list(pool.idle):
            old.close()
        return None

    async def _connect(self, pool: _Pool) -> Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(pool, self.read_timeout_s, self.loop), pool.host, pool.port, ssl=pool.ssl,
                    server_hostname=pool.host if pool.ssl is not None else None)
        except TimeoutError:
            raise UpstreamUnreachable(f"connect to {pool.host}:{pool.port} timed out after "
                                      f"{self.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"connect to {pool.host}:{pool.port}: {exc!r}") from None
        if connected_to_itself(conn.transport):  # nothing listens there: a refused connect
            conn.closed = True  # not in the pool yet: the caller gives its slot back
            await drop(conn.transport)
            raise UpstreamUnreachable(f"connect to {pool.host}:{pool.port}: nothing listens "
                                      "(the connection reached itself)")
        return conn

    def release(self, conn: Connection) -> None:
        """A connection whose response was read to the end goes back to its pool."""
        pool = conn.pool
        if self._pools.get(pool.key) is not pool:
            conn.close()  # the transport was closed meanwhile
            return
        conn.phase = IDLE
        conn.idle_since_s = self.loop.time()
        pool.idle.append(conn)
        if pool.sweep is None:
            pool.sweep = self.loop.call_at(conn.idle_since_s + self.keepalive_s,
                                           self._sweep, pool)
        pool.wake_one()

    def _sweep(self, pool: _Pool) -> None:
        """Close the pool's connections idle for ``keepalive_s``; come back for the next."""
        pool.sweep = None
        now_s = self.loop.time()
        while pool.idle and now_s - pool.idle[0].idle_since_s + 0.001 >= self.keepalive_s:
            pool.idle[0].close()
        if pool.idle:
            pool.sweep = self.loop.call_at(pool.idle[0].idle_since_s + self.keepalive_s,
                                           self._sweep, pool)
