"""One upstream HTTP/1.1 connection of the ``h1`` client (:mod:`guard.proxy.h1_transport`): an
:class:`asyncio.Protocol` that writes one request at a time and parses its response as the
bytes arrive (head, then the body de-framed into :meth:`Connection.next_body` items).

Its exchange ends in one of: the body read to the end (``body_complete``: the pool may take the
connection back when ``keep_alive``), :class:`Stale` (closed before any response byte),
:class:`~guard.proxy.transports.UpstreamUnreachable` (garbage or a close inside the head),
:class:`~guard.proxy.transports.UpstreamTimeout` (``read_timeout_s`` of silence while waited
on) or :class:`~guard.proxy.transports.UpstreamBroken` (cut or malformed body).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

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
)
from guard.proxy.transports import (
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = ["Connection", "Stale", "HEAD", "BODY", "DONE", "IDLE", "HIGH_WATER_BYTES"]

HIGH_WATER_BYTES = 64 * 1024  # body bytes not yet taken by the consumer before reading pauses
HEAD, BODY, DONE, IDLE = range(4)  # a connection's phase (IDLE: in its pool)


class Stale(UpstreamUnreachable):
    """The connection closed before any byte of the response (a reused one may be retried)."""


class Connection(asyncio.Protocol):
    """One upstream connection: one exchange at a time, its response parsed as it arrives."""

    def __init__(self, pool: Any, read_timeout_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool  # .forget(conn) once closed, .host, .port
        self.read_timeout_s = read_timeout_s
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.phase = DONE
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
        # push_body(): each body piece goes to sink(data, last) from data_received
        self._sink: Any = None

    # --- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.phase == BODY:
            self._body(data)
        elif self.phase == HEAD:
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
        if phase == HEAD:
            if self._got_bytes:
                self._fail(UpstreamUnreachable(f"{self._name()} closed the connection inside "
                                               f"the response head ({exc!r})"))
            else:
                self._fail(Stale(f"{self._name()} closed the connection before any response "
                                  f"({exc!r})"))
        elif phase == BODY:
            if self._framing == UNTIL_CLOSE:
                self.phase = DONE
                self._wake()
            else:
                self._fail(UpstreamBroken(f"{self._name()} closed the connection mid-body "
                                          f"({exc!r})"))
        self.pool.forget(self)

    # --- one exchange --------------------------------------------------------------------
    def start(self, request: bytes) -> None:
        """Write one request; its response head is awaited with :meth:`read_head`."""
        self.phase = HEAD
        self.num_exchanges += 1
        self.head = None
        self._buffer = b""
        self._got_bytes = False
        self._error = None
        self._pending = []
        self._num_pending_bytes = 0
        if self.closed:
            self._error = Stale(f"{self._name()}: the connection was closed")
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
            if self.phase != BODY:
                return None
            await self._wait()

    async def push_body(self, sink: Any) -> bool:
        """Hand the body on as it arrives, without waking the caller per read:
        ``sink(data, last)`` is called from the protocol callback for each piece (``last``: the
        body ends with it) and must not raise. Returns True at the end of the body, False once
        the sink called :meth:`stop_push` (it cannot take more now: call again when it can).
        Raises like :meth:`next_body`; the read timeout still applies to each silence."""
        self._sink = sink
        try:
            while True:
                if self._sink is None:
                    return False
                if self._pending:  # arrived before the push began
                    pending = self._pending
                    data = pending[0] if len(pending) == 1 else b"".join(pending)
                    self._pending = []
                    self._num_pending_bytes = 0
                    sink(data, self.phase == DONE and self._error is None)
                    continue
                if self._error is not None:
                    raise self._error
                if self.phase != BODY:
                    return True
                if self._paused:
                    self._paused = False
                    if not self.closed:
                        self.transport.resume_reading()
                await self._wait()
        finally:
            self._sink = None

    def stop_push(self) -> None:
        """From the sink: take no more now (reading pauses until :meth:`push_body` again)."""
        if self._sink is not None:
            self._sink = None
            if not self._paused and not self.closed:
                self._paused = True
                self.transport.pause_reading()
            self._wake()

    @property
    def body_complete(self) -> bool:
        return self.phase == DONE and self._error is None

    @property
    def body_taken(self) -> bool:
        """The body is complete and :meth:`next_body` has handed all of it on."""
        return self.phase == DONE and self._error is None and not self._pending

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
        self.phase = BODY
        if head.framing == CHUNKED:
            self._decoder = ChunkedDecoder()
        elif head.framing == LENGTH:
            self._left = head.length
            if not self._left:
                self.phase = DONE
        elif head.framing == NO_BODY:
            self.phase = DONE
        self._wake()
        if buffer:
            if self.phase == BODY:
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
                self.phase = DONE
                self.keep_alive = self.keep_alive and not decoder.extra
        elif framing == LENGTH:
            if len(data) >= self._left:
                if len(data) > self._left:
                    data = data[:self._left]
                    self.keep_alive = False  # more than the body: not trustworthy
                self.phase = DONE
            self._left -= len(data)
        if data:
            sink = self._sink
            if sink is not None:
                self._wait_since_s = self.loop.time()  # a new silence window
                sink(data, self.phase == DONE)
                if self.phase != DONE and self._error is None:
                    return  # nobody to wake: the sink has it
                self._wake()
                return
            self._pending.append(data)
            self._num_pending_bytes += len(data)
            if self._num_pending_bytes > HIGH_WATER_BYTES and not self._paused:
                self._paused = True
                self.transport.pause_reading()
        elif self.phase == DONE and self._sink is not None:
            # the end of a chunked body read on its own (an upstream writes its last chunk and
            # the terminator apart): the sink ends the client's body from here too, not the
            # consumer's task after a wake-up
            self._sink(b"", True)
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
            self._timer = self.loop.call_at(self._wait_since_s + self.read_timeout_s,
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
        due_s = self._wait_since_s + self.read_timeout_s
        if self.loop.time() + 0.001 >= due_s:
            what = "response head" if self.phase == HEAD else "body bytes"
            waiter.set_exception(UpstreamTimeout(
                f"{self._name()} sent no {what} within {self.read_timeout_s:g} s"))
        else:
            self._timer = self.loop.call_at(due_s, self._on_timer)

    def _name(self) -> str:
        return f"{self.pool.host}:{self.pool.port}"
