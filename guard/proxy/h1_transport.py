"""``upstream_client = "h1"``: the proxy's upstream :class:`~guard.proxy.transports.Transport`
on raw asyncio protocols (``loop.create_connection`` and an :class:`asyncio.Protocol` per
connection; messages in :mod:`guard.proxy.h1_message`).

* **Pool** per ``(host, port)``: keep-alive connections, at most ``max_connections_per_replica``
  open to one replica (more requests wait for one), the most recently used taken first; a
  connection goes back only once its response was read to the end, and an idle one is closed
  ``keepalive_s`` after its last response (before the upstream's own keep-alive would close it
  under a request).
* **A reused connection that fails before any response byte** (the upstream closed it as the
  request went out) is retried once on a fresh connection; a fresh one that fails so, or any
  garbage before the end of the response head, is :class:`UpstreamUnreachable`.
* **Timeouts**: ``connect_timeout_s`` on connect (:class:`UpstreamUnreachable`),
  ``read_timeout_s`` of silence while waiting for the head or the next body bytes
  (:class:`UpstreamTimeout`); a cut or malformed body is :class:`UpstreamBroken`.
* **Bodies** (``content-length``, chunked — de-chunked here — or until close) are handed on as
  they arrive: one :meth:`chunks` item per read from the socket (what arrived while the consumer
  was busy is joined into the next item). Past ``_HIGH_WATER_BYTES`` not yet taken, reading from
  the upstream pauses until the consumer takes them.
* :meth:`aclose` on a response whose body is not all in closes its connection at once (the
  upstream sees its client go and frees the request's KV).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from urllib.parse import urlsplit

from guard.proxy.h1_message import (
    CHUNKED,
    LENGTH,
    MAX_HEAD_BYTES,
    NO_BODY,
    UNTIL_CLOSE,
    ChunkedDecoder,
    MessageError,
    ResponseHead,
    parse_head,
    request_head,
)
from guard.proxy.transports import (
    _KEEPALIVE_S,
    Headers,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = ["H1Transport"]

_HIGH_WATER_BYTES = 64 * 1024  # body bytes not yet taken by the consumer before reading pauses
_MAX_TARGETS = 1024  # parsed URLs kept (replicas x routes: a handful in practice)
_HEAD, _BODY, _DONE, _IDLE = range(4)  # a connection's phase


class _Stale(UpstreamUnreachable):
    """The connection closed before any byte of the response (a reused one may be retried)."""


class _Pool:
    """The connections to one ``(host, port)``."""

    __slots__ = ("key", "host", "port", "ssl", "idle", "num_open", "waiters", "sweep")

    def __init__(self, key: tuple[str, str, int], ssl_context: ssl.SSLContext | None) -> None:
        self.key = key
        _, self.host, self.port = key
        self.ssl = ssl_context
        self.idle: list[_Connection] = []  # oldest first
        self.num_open = 0  # idle, busy and connecting
        self.waiters: deque[asyncio.Future] = deque()
        self.sweep: asyncio.TimerHandle | None = None

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def forget(self, conn: _Connection) -> None:
        """``conn`` is closed: its slot is free."""
        self.num_open -= 1
        if conn.phase == _IDLE:
            self.idle.remove(conn)
        self.wake_one()


class _Connection(asyncio.Protocol):
    """One upstream connection: one exchange at a time, its response parsed as it arrives."""

    def __init__(self, transport_: H1Transport, pool: _Pool) -> None:
        self.owner = transport_
        self.pool = pool
        self.loop = transport_.loop
        self.transport: asyncio.Transport | None = None
        self.phase = _DONE
        self.closed = False
        self.num_exchanges = 0
        self.idle_since_s = 0.0
        self.keep_alive = True
        self.head: ResponseHead | None = None
        self._buffer = b""
        self._got_bytes = False
        self._framing = NO_BODY
        self._left = 0
        self._decoder: ChunkedDecoder | None = None
        self._pending: list[bytes] = []
        self._num_pending_bytes = 0
        self._paused = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._wait_since_s = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.phase == _BODY:
            self._body(data)
        elif self.phase == _HEAD:
            self._got_bytes = True
            self._head_bytes(data)
        else:  # bytes nobody asked for: the connection cannot be trusted again
            self.close()

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost tells the rest

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.closed or self.transport is None:
            return  # closed here: the exchange's outcome is already decided
        self.closed = True
        phase = self.phase
        if phase == _HEAD:
            if self._got_bytes:
                self._fail(UpstreamUnreachable(f"{self._name()} closed the connection inside "
                                               f"the response head ({exc!r})"))
            else:
                self._fail(_Stale(f"{self._name()} closed the connection before any response "
                                  f"({exc!r})"))
        elif phase == _BODY:
            if self._framing == UNTIL_CLOSE:
                self.phase = _DONE
                self._wake()
            else:
                self._fail(UpstreamBroken(f"{self._name()} closed the connection mid-body "
                                          f"({exc!r})"))
        self.pool.forget(self)

    # --- one exchange --------------------------------------------------------------------
    def start(self, request: bytes) -> None:
        """Write one request; its response head is awaited with :meth:`read_head`."""
        self.phase = _HEAD
        self.num_exchanges += 1
        self.head = None
        self._buffer = b""
        self._got_bytes = False
        self._error = None
        self._pending = []
        self._num_pending_bytes = 0
        if self.closed:
            self._error = _Stale(f"{self._name()}: the connection was closed")
            return
        self.transport.write(request)

    async def read_head(self) -> ResponseHead:
        while self.head is None:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.head

    async def next_body(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some); None at the end."""
        while True:
            if self._pending:
                pending = self._pending
                data = pending[0] if len(pending) == 1 else b"".join(pending)
                self._pending = []
                self._num_pending_bytes = 0
                if self._paused:
                    self._paused = False
                    if not self.closed:
                        self.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self.phase != _BODY:
                return None
            await self._wait()

    @property
    def body_complete(self) -> bool:
        return self.phase == _DONE and self._error is None

    def close(self) -> None:
        """Close at once (mid-response: the upstream sees its client go)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)

    # --- parsing -------------------------------------------------------------------------
    def _head_bytes(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        while True:
            split = buffer.find(b"\r\n\r\n")
            if split < 0:
                self._buffer = buffer
                if len(buffer) > MAX_HEAD_BYTES:
                    self._garbage("response head too long")
                return
            try:
                head = parse_head(buffer[:split])
            except MessageError as exc:
                self._garbage(str(exc))
                return
            buffer = buffer[split + 4:]
            if head.status >= 200:
                break
            if head.status == 101:
                self._garbage("101 switching protocols was never asked for")
                return
            # 100 / 102 / 103: an interim head; the real one follows
        self._buffer = b""
        self.head = head
        self.keep_alive = head.keep_alive
        self._framing = head.framing
        self.phase = _BODY
        if head.framing == CHUNKED:
            self._decoder = ChunkedDecoder()
        elif head.framing == LENGTH:
            self._left = head.length
            if not self._left:
                self.phase = _DONE
        elif head.framing == NO_BODY:
            self.phase = _DONE
        self._wake()
        if buffer:
            if self.phase == _BODY:
                self._body(buffer)
            else:
                self.keep_alive = False

    def _body(self, data: bytes) -> None:
        framing = self._framing
        if framing == CHUNKED:
            decoder = self._decoder
            try:
                pieces = decoder.feed(data)
            except MessageError as exc:
                self._fail(UpstreamBroken(f"{self._name()}: bad chunked body: {exc}"))
                self.close()
                return
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if decoder.done:
                self.phase = _DONE
                self.keep_alive = self.keep_alive and not decoder.extra
        elif framing == LENGTH:
            if len(data) >= self._left:
                if len(data) > self._left:
                    data = data[:self._left]
                    self.keep_alive = False  # more than the body: not trustworthy
                self.phase = _DONE
            self._left -= len(data)
        if data:
            self._pending.append(data)
            self._num_pending_bytes += len(data)
            if self._num_pending_bytes > _HIGH_WATER_BYTES and not self._paused:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def _garbage(self, why: str) -> None:
        self._fail(UpstreamUnreachable(f"{self._name()} sent an invalid response head: {why}"))
        self.close()

    # --- waiting -------------------------------------------------------------------------
    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = waiter = self.loop.create_future()
        self._wait_since_s = self.loop.time()
        if self._timer is None:  # one timer per silence window, not one per wait
            self._timer = self.loop.call_at(self._wait_since_s + self.owner.read_timeout_s,
                                            self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        due_s = self._wait_since_s + self.owner.read_timeout_s
        if self.loop.time() + 0.001 >= due_s:
            what = "response head" if self.phase == _HEAD else "body bytes"
            waiter.set_exception(UpstreamTimeout(
                f"{self._name()} sent no {what} within {self.owner.read_timeout_s:g} s"))
        else:
            self._timer = self.loop.call_at(due_s, self._on_timer)

    def _name(self) -> str:
        return f"{self.pool.host}:{self.pool.port}"


class _Response:
    """:class:`~guard.proxy.transports.UpstreamResponse` over one :class:`_Connection`."""

    __slots__ = ("status", "headers", "_conn", "_closed")

    def __init__(self, conn: _Connection, head: ResponseHead) -> None:
        self._conn = conn
        self.status = head.status
        self.headers = head.headers
        self._closed = False

    async def chunks(self):
        next_body = self._conn.next_body
        while (data := await next_body()) is not None:
            yield data

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.body_complete and conn.keep_alive and not conn.closed:
            conn.owner.release(conn)
        else:
            conn.close()


class H1Transport:
    """Pooled HTTP/1.1 client on asyncio protocols (created idle; pools made on first use)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 max_connections_per_replica: int, num_replicas: int = 1, *,
                 keepalive_s: float = _KEEPALIVE_S) -> None:
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

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._exchange(url, b"GET", [], None)
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
    async def _exchange(self, url: str, method: bytes, headers: Headers,
                        body: bytes | None) -> _Response:
        pool, target, host = self._target(url)
        request = request_head(method, target, host, headers,
                               None if body is None else len(body))
        if body:
            request += body
        fresh = False
        while True:
            conn = await self._acquire(pool, fresh)
            conn.start(request)
            try:
                head = await conn.read_head()
            except _Stale as exc:
                conn.close()
                if conn.num_exchanges > 1 and not fresh:
                    fresh = True  # the upstream closed a pooled connection under us: once more
                    continue
                raise UpstreamUnreachable(str(exc)) from None
            except BaseException:
                conn.close()
                raise
            return _Response(conn, head)

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
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        known = (pool, target.encode("latin-1"), host.encode("latin-1"))
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = known
        return known

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    # --- the pool ------------------------------------------------------------------------
    async def _acquire(self, pool: _Pool, fresh: bool) -> _Connection:
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

    def _pop_idle(self, pool: _Pool) -> _Connection | None:
        conn = pool.idle.pop()
        if self.loop.time() - conn.idle_since_s < self.keepalive_s:
            conn.phase = _DONE
            return conn
        conn.phase = _DONE  # expired, and every older one too
        conn.close()
        for old in list(pool.idle):
            old.close()
        return None

    async def _connect(self, pool: _Pool) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, pool), pool.host, pool.port, ssl=pool.ssl,
                    server_hostname=pool.host if pool.ssl is not None else None)
        except TimeoutError:
            raise UpstreamUnreachable(f"connect to {pool.host}:{pool.port} timed out after "
                                      f"{self.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"connect to {pool.host}:{pool.port}: {exc!r}") from None
        return conn

    def release(self, conn: _Connection) -> None:
        """A connection whose response was read to the end goes back to its pool."""
        pool = conn.pool
        if self._pools.get(pool.key) is not pool:
            conn.close()  # the transport was closed meanwhile
            return
        conn.phase = _IDLE
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
