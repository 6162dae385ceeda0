"""A small pipelined Redis client for the budget hot path: one connection, RESP2, five commands.

Why: most of the CPU redis-py's asyncio client spends on an EVALSHA goes around the command
(connection pool checkout, command packing, its pure-Python reply parser, per-call locks and
timeouts), not into the bytes on the wire; a budget decision is one EVALSHA per batch of
concurrent requests, so that overhead is most of what Redis budgets add per request (the
figures are in docs/benchmarks.md §5 and §11). This client speaks exactly what the budget store needs — ``EVALSHA``,
``SCRIPT LOAD``, ``PING``, ``INFO`` (and ``AUTH``/``SELECT`` at connect) — with the interface
the store already uses (``evalsha``, ``script_load``, ``ping``, ``info``, ``aclose``) and
redis-py's exception types, so :class:`~guard.budget.redis_store.RedisStore` and
:class:`~guard.budget.fallback.FallbackStore` run unchanged on either. Redis Cluster stays on
redis-py's cluster client (:func:`guard.budget.connection.connect` picks).

Commands are pipelined on one connection: replies come back in order, so each call waits on a
future in a FIFO (Redis runs commands one at a time anyway; a pool would only add connects).
A call waits at most ``timeout_s`` (redis-py's ``socket_timeout``): past it the call raises
``redis.exceptions.TimeoutError`` and the connection is closed (every call still waiting on it
fails with ``ConnectionError``), as redis-py drops a connection that timed out — a hung or
black-holed server never keeps a dead socket. The next call connects again (bounded by the same
timeout). Replies are decoded as UTF-8 strings (``decode_responses=True``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from guard.budget.resp import ErrorReply, RespParser, encode_command
from guard.self_connect import connected_to_itself, drop

__all__ = ["RespClient", "supports"]

MAX_PENDING_CALLS = 10_000  # calls waiting on one connection (a hung server: fail, not grow)


def supports(url: str) -> bool:
    """Whether ``url`` is one this client handles: ``redis://[[user]:password@]host[:port][/db]``
    with no query (TLS, unix sockets and options go to redis-py)."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.query or parts.fragment or not parts.hostname:
        return False
    db = parts.path.lstrip("/")
    return db == "" or db.isdigit()


class _Protocol(asyncio.Protocol):
    def __init__(self, client: RespClient) -> None:
        self._client = client
        self.parser = RespParser()
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future] = deque()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        try:
            replies = self.parser.replies()
        except ValueError as exc:
            self.fail(RedisConnectionError(str(exc)))
            self.transport.close()
            return
        waiting = self.waiting
        for reply in replies:
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self.fail(RedisConnectionError("redis sent a reply no call was waiting for"))
                self.transport.close()
                return
            future = waiting.popleft()
            if future.done():  # its caller gave up (timeout or cancel): the reply is dropped
                continue
            if isinstance(reply, ErrorReply):
                future.set_exception(reply.exception())
            else:
                future.set_result(reply)

    def connection_lost(self, exc) -> None:
        self.fail(RedisConnectionError(f"redis connection lost: {exc!r}" if exc
                                       else "redis closed the connection"))
        self._client._lost(self)

    def fail(self, exc: Exception) -> None:
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)


class RespClient:
    """See the module docstring. Create with :meth:`from_url`; no I/O until the first call."""

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout_s: float = 0.05) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self.host, self.port, self.db = host, port, db
        self._username, self._password = username, password
        self.timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> RespClient:
        if not supports(url):
            raise ValueError(f"redis url not handled by the budget client: {url!r}")
        parts = urlsplit(url)
        db = parts.path.lstrip("/")
        return cls(parts.hostname, parts.port or 6379, db=int(db) if db else 0,
                   username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None,
                   timeout_s=timeout_s)

    # --- the commands the budget store uses ---------------------------------------------

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return await self.execute("EVALSHA", sha, numkeys, *keys_and_args)

    async def script_load(self, body: str) -> str:
        return await self.execute("SCRIPT", "LOAD", body)

    async def ping(self) -> bool:
        return await self.execute("PING") == "PONG"

    async def info(self, section: str | None = None) -> dict[str, Any]:
        text = await self.execute("INFO", *(() if section is None else (section,)))
        out: dict[str, Any] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and ":" in line:
                key, _, value = line.partition(":")
                out[key] = int(value) if value.lstrip("-").isdigit() else value
        return out

    async def aclose(self) -> None:
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.fail(RedisConnectionError("redis client closed"))
            protocol.transport.close()

    # --- the pipeline ----------------------------------------------------------------------

    async def execute(self, *args: Any) -> Any:
        """Send one command; its reply (an error reply raises; past ``timeout_s``:
        ``redis.exceptions.TimeoutError`` and the connection is dropped)."""
        protocol = self._protocol
        if protocol is None or protocol.transport.is_closing():
            protocol = await self._connect()
        return await self._send(protocol, encode_command(args))

    async def _send(self, protocol: _Protocol, data: bytes) -> Any:
        if len(protocol.waiting) >= MAX_PENDING_CALLS:
            raise RedisConnectionError("too many redis calls waiting on one connection")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        protocol.waiting.append(future)
        protocol.transport.write(data)
        timer = loop.call_later(self.timeout_s, self._timed_out, protocol, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _timed_out(self, protocol: _Protocol, future: asyncio.Future) -> None:
        if future.done():
            return
        future.set_exception(RedisTimeoutError(
            f"redis did not answer within {self.timeout_s * 1000:.0f} ms"))
        self._drop(protocol)

    def _drop(self, protocol: _Protocol) -> None:
        """Close ``protocol``'s connection (its waiting calls fail); the next call reconnects."""
        if self._protocol is protocol:
            self._protocol = None
        protocol.fail(RedisConnectionError("redis connection dropped after a timeout"))
        protocol.transport.close()

    def _lost(self, protocol: _Protocol) -> None:
        if self._protocol is protocol:
            self._protocol = None

    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RedisConnectionError("redis client closed")
        if self._connecting is None:  # one connect shared by every caller that needs it
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, connecting: asyncio.Future) -> None:
        if self._connecting is connecting:
            self._connecting = None
        if not connecting.cancelled():
            connecting.exception()  # retrieved: the callers waiting on it got it too

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _Protocol(self), self.host, self.port),
                self.timeout_s)
        except asyncio.TimeoutError:
            raise RedisTimeoutError(f"redis connect to {self.host}:{self.port} timed out") \
                from None
        except OSError as exc:
            raise RedisConnectionError(f"redis connect to {self.host}:{self.port}: {exc}") \
                from None
        if connected_to_itself(protocol.transport):  # nothing listens: a refused connect
            await drop(protocol.transport)
            raise RedisConnectionError(f"redis connect to {self.host}:{self.port}: nothing "
                                       "listens (the connection reached itself)")
        try:
            sock = protocol.transport.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._password is not None:
                auth = (("AUTH", self._username, self._password) if self._username
                        else ("AUTH", self._password))
                await self._send(protocol, encode_command(auth))
            if self.db:
                await self._send(protocol, encode_command(("SELECT", self.db)))
        except BaseException:
            protocol.transport.close()
            raise
        if self._closed:
            protocol.transport.close()
            raise RedisConnectionError("redis client closed")
        self._protocol = protocol
        return protocol
