"""The load generator's client on raw asyncio protocols (``--client raw``): a cheaper sender.

``chaos.client.CompletionClient`` over aiohttp costs the generator enough CPU per request
(``kvguard bench loadgen``, docs/benchmarks.md §10) that under ``kvguard bench sheds``
(2,000 req/s on 2 cores) the sender takes most of a core from the machine the measured replica
runs on, and its own CPU becomes part of the shed tail being measured. :class:`RawCompletionClient` is the same client — same request, same
``send()`` contract (never raises for a request-level problem), same record, the same SSE line
handling — with the HTTP/1.1 exchange done on a keep-alive connection pool of asyncio
protocols instead of aiohttp.

It measures the same span: ``send()`` stamps the start before a connection is taken from the
pool (or opened) and the end once the whole response has been read (status line, headers and
body to its last byte: ``content-length``, chunked framing through ``serving.chunked``, or the
connection's close); each streamed token is stamped in the callback its bytes arrive in.

One request at a time per connection (no pipelining); at most ``max_connections`` requests in
flight (more wait for one to end). A connection goes back to the pool only after a complete
response that did not say ``connection: close``; one whose request was cut short (timeout,
cancel, a malformed stream) is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from chaos.client import _ERROR_BODY_BYTES, MAX_IDLE_S, CompletionClient, Observation
from chaos.records import RequestSpec
from serving.chunked import ChunkedDecoder, ChunkedError

__all__ = ["RawCompletionClient", "RawConnectionPool"]

_MAX_HEAD_BYTES = 64 * 1024


class ResponseError(OSError):
    """A response that is not valid HTTP/1.1, or a connection lost before it ended."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one exchange at a time, parsed as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._done: asyncio.Future | None = None
        self._obs: Observation | None = None
        self._on_line: Callable[[bytes, Observation], bool] | None = None
        self._head = b""
        self._status = 0
        self._keep_alive = True
        self._length: int | None = None  # body bytes left (content-length); None: other framing
        self._chunks: ChunkedDecoder | None = None
        self._until_close = False
        self._ok = False  # a 2xx: the body is an SSE stream
        self._pending = b""  # an SSE line split across reads
        self._error_body = b""
        self._stream_done = False

    # --- one exchange ---------------------------------------------------------------------
    def exchange(self, request: bytes, obs: Observation,
                 on_line: Callable[[bytes, Observation], bool]) -> asyncio.Future:
        """Write ``request``; the future ends True (keep the connection) once the response
        ended, or with ``ResponseError``/``ValueError`` (close it)."""
        self._done = done = asyncio.get_running_loop().create_future()
        self._obs, self._on_line = obs, on_line
        self._head, self._status, self._keep_alive = b"", 0, True
        self._length, self._chunks, self._until_close = None, None, False
        self._pending, self._error_body, self._stream_done = b"", b"", False
        self.transport.write(request)
        return done

    # --- asyncio callbacks ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._until_close and self._status:
            self._end()  # a body framed by the connection's close
        else:
            self._fail(ResponseError("connection closed before the response ended"))

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            self.close()  # bytes nobody asked for
            return
        try:
            if not self._status:
                data = self._read_head(data)
                if data is None:
                    return
            self._read_body(data)
        except (ResponseError, ChunkedError, ValueError) as exc:
            self._fail(exc if not isinstance(exc, ChunkedError) else ResponseError(str(exc)))

    # --- parsing --------------------------------------------------------------------------
    def _read_head(self, data: bytes) -> bytes | None:
        """The status line and headers; returns the bytes after them (None: head incomplete)."""
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > _MAX_HEAD_BYTES:
                raise ResponseError("response head too large")
            self._head = head
            return None
        self._head = b""
        lines = head[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status = rest[:3]
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ResponseError(f"bad status line {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise ResponseError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        self._start(int(status), version, headers)
        return head[end + 4:]

    def _start(self, status: int, version: str, headers: dict[str, str]) -> None:
        obs = self._obs
        obs.status, obs.headers = status, headers
        self._status = status
        self._ok = 200 <= status < 300
        connection = headers.get("connection", "").lower()
        self._keep_alive = "close" not in connection and (version == "HTTP/1.1"
                                                          or "keep-alive" in connection)
        if status < 200 or status in (204, 304):
            self._length = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunks = ChunkedDecoder(trailer_field=None)
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise ResponseError(f"bad content-length {length[:40]!r}")
            self._length = int(length)
        else:
            self._until_close, self._keep_alive = True, False

    def _read_body(self, data: bytes) -> None:
        if self._chunks is not None:
            out: list[bytes] = []
            used = self._chunks.decode(data, out)
            for part in out:
                self._body(part)
            if self._chunks.done:
                if used != len(data):
                    self._keep_alive = False  # bytes past the response: not reusable
                self._end()
        elif self._length is not None:
            take = data[:self._length]
            self._length -= len(take)
            if take:
                self._body(take)
            if not self._length:
                if len(take) != len(data):
                    self._keep_alive = False
                self._end()
        elif data:
            self._body(data)  # until the connection closes

    def _body(self, data: bytes) -> None:
        if not self._ok:
            if len(self._error_body) < _ERROR_BODY_BYTES:
                self._error_body += data[:_ERROR_BODY_BYTES - len(self._error_body)]
            return
        if self._stream_done:
            return
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if self._on_line(line.rstrip(b"\r"), self._obs):
                self._stream_done = True  # [DONE]: what follows is not read as tokens
                return

    def _end(self) -> None:
        if not self._ok:
            self._obs.error = (f"HTTP {self._status}: "
                               f"{self._error_body.decode(errors='replace')}")
        elif self._pending and not self._stream_done:
            self._on_line(self._pending.rstrip(b"\r"), self._obs)  # a last line without \n
        done = self._done
        if done is not None and not done.done():
            done.set_result(self._keep_alive)

    def _fail(self, exc: BaseException) -> None:
        done = self._done
        if done is not None and not done.done():
            done.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class RawConnectionPool:
    """Keep-alive connections to one ``host:port``; at most ``max_connections`` in use; one
    idle for ``max_idle_s`` or longer is closed, not reused (``MAX_IDLE_S``)."""

    def __init__(self, host: str, port: int, max_connections: int,
                 max_idle_s: float = MAX_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not max_idle_s > 0:
            raise ValueError(f"max_idle_s must be > 0, got {max_idle_s}")
        self.host, self.port = host, port
        self.num_opened = 0  # connections opened over the pool's life
        self.num_retired = 0  # idle ones closed for having waited max_idle_s
        self._max_idle_s = max_idle_s
        self._clock = clock
        self._idle: list[tuple[_Connection, float]] = []  # (connection, idle since)
        self._slots = asyncio.Semaphore(max_connections)

    async def acquire(self) -> _Connection:
        await self._slots.acquire()
        try:
            while self._idle:
                conn, idle_since_s = self._idle.pop()  # the most recently used: warm
                if conn.closed:
                    continue
                if self._clock() - idle_since_s >= self._max_idle_s:
                    conn.close()  # the server may be closing it right now
                    self.num_retired += 1
                    continue
                return conn
            _, conn = await asyncio.get_running_loop().create_connection(
                _Connection, self.host, self.port)
            self.num_opened += 1
            return conn
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.closed:
            self._idle.append((conn, self._clock()))
        else:
            conn.close()
        self._slots.release()

    def close(self) -> None:
        for conn, _ in self._idle:
            conn.close()
        self._idle.clear()


class RawCompletionClient(CompletionClient):
    """:class:`chaos.client.CompletionClient` with the exchange on a :class:`RawConnectionPool`
    (``http`` is that pool)."""

    def __init__(self, http: RawConnectionPool, base_url: str, **kwargs) -> None:
        if kwargs.get("failover") is not None:
            raise ValueError("the raw client talks to one entry: no failover")
        super().__init__(http, base_url, **kwargs)  # type: ignore[arg-type]
        parts = urlsplit(base_url.rstrip("/") + "/v1/completions")
        self._path_line = f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode()

    def _request(self, spec: RequestSpec, body: bytes) -> bytes:
        head = "".join(f"{name}: {value}\r\n" for name, value in self._headers(spec).items())
        return b"%s%scontent-length: %d\r\n\r\n%s" % (
            self._path_line, head.encode("latin-1"), len(body), body)

    async def _exchange(self, spec: RequestSpec, body: bytes, obs: Observation) -> None:
        pool: RawConnectionPool = self._http  # type: ignore[assignment]
        conn = await pool.acquire()
        reusable = False
        try:
            reusable = await conn.exchange(self._request(spec, body), obs, self._on_line)
        finally:
            pool.release(conn, reusable)
