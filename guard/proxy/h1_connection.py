"""One upstream HTTP/1.1 connection of the ``h1`` client (:mod:`guard.proxy.h1_transport`): an
:class:`asyncio.Protocol` that writes one request at a time and parses its response as the
bytes arrive (head, then the body de-framed into :meth:`Connection.next_body` items).

Its exchange ends in one of (the tree of :mod:`guard.proxy.upstream_contract`): the body read to
the end (``reusable``: the pool may take the connection back), :class:`Stale` (the connection
was found closed before the request was written: it may be sent again on another),
:class:`~guard.proxy.upstream_contract.UpstreamBroken` (closed after the request was written,
before or inside the response: never sent again), :class:`~guard.proxy.upstream_contract.
UpstreamMalformed` (a response that is not valid HTTP/1.1, found as soon as its bytes show it:
a bare LF in the head, a bad header field, an unsupported framing) or
:class:`~guard.proxy.upstream_contract.UpstreamTimeout` (``read_timeout_s`` since the last byte
arrived, while the response is waited on).
"""

from __future__ import annotations

import asyncio
import select
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
from guard.proxy.upstream_contract import (
    UpstreamBroken,
    UpstreamError,
    UpstreamMalformed,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = ["Connection", "Stale", "HEAD", "BODY", "DONE", "IDLE", "HIGH_WATER_BYTES"]

HIGH_WATER_BYTES = 64 * 1024  # body bytes not yet taken by the consumer before reading pauses
HEAD, BODY, DONE, IDLE = range(4)  # a connection's phase (IDLE: in its pool)


class Stale(UpstreamUnreachable):
    """A pooled connection was found closed before the request was written on it."""


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
        self._silent_since_s = 0.0  # the last byte, or the start of the wait when later
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
        self._silent_since_s = self.loop.time()
        if self.phase == BODY:
            self._body(data)
        elif self.phase == HEAD:
            self._got_bytes = True
            self._head_bytes(data)
        else:  # bytes nobody asked for: the connection cannot be trusted again
            self.close()

    def eof_received(self) -> bool:
        if self.phase in (IDLE, DONE):  # closed between exchanges: out of the pool at once
            self.close()
        return False  # let the transport close; connection_lost tells the rest

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.closed or self.transport is None:
            return  # closed here: the exchange's outcome is already decided
        self.closed = True
        phase = self.phase
        if phase == HEAD:  # the request was written: the upstream may have acted on it
            where = "inside the response head" if self._got_bytes else "before any response"
            self._fail(UpstreamBroken(f"{self._name()} closed the connection {where} ({exc!r})"))
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
        if self.closed or self.transport.is_closing():
            self._error = Stale(f"{self._name()}: the connection was closed before the request "
                                "was written")
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
                return self._take_pending()
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
                    data = self._take_pending()
                    sink(data, self.phase == DONE and self._error is None)
                    continue
                if self._error is not None:
                    raise self._error
                if self.phase != BODY:
                    return True
                self._resume()
                await self._wait()
        finally:
            self._sink = None

    def _take_pending(self) -> bytes:
        """The body bytes not yet handed on, joined; reading resumes if they had paused it."""
        pending = self._pending
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        self._pending = []
        self._num_pending_bytes = 0
        self._resume()
        return data

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if not self.closed:
                self.transport.resume_reading()

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

    def peer_spoke(self) -> bool:
        """True when an idle plain-TCP connection has input waiting: the upstream's close (or
        bytes nobody asked for) arrived and the loop has not read it yet. Checked before a
        pooled connection takes a request, so that a close already on its way is not met by
        a write (which could not be sent again)."""
        if self.closed or self.transport.get_extra_info("sslcontext") is not None:
            return False
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    @property
    def reusable(self) -> bool:
        """The exchange is over and left the connection fit for the next request: the body
        read from it to the end (what was not handed on is dropped), reading not paused, no
        close asked for."""
        return (self.phase == DONE and self._error is None and not self._paused
                and self.keep_alive and not self.closed and not self.transport.is_closing())

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
            end = split if split >= 0 else len(buffer)
            if buffer.count(b"\n", 0, end) != buffer.count(b"\r\n", 0, end):
                self._garbage("a bare LF in the response head")  # now, not at the timeout
                return
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
                self._fail(UpstreamMalformed(f"{self._name()}: bad chunked body: {exc}"))
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
        self._fail(UpstreamMalformed(f"{self._name()} sent an invalid response head: {why}"))
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
        # silence counts while the response is waited on: from the later of the last byte
        # and this wait's start (data_received moves it on; the timer re-arms to match)
        self._silent_since_s = self.loop.time()
        if self._timer is None:  # one timer per silence window, not one per wait
            self._timer = self.loop.call_at(self._silent_since_s + self.read_timeout_s,
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
        due_s = self._silent_since_s + self.read_timeout_s
        if self.loop.time() + 0.001 >= due_s:
            what = "response head" if self.phase == HEAD else "body bytes"
            waiter.set_exception(UpstreamTimeout(
                f"{self._name()} sent no {what} within {self.read_timeout_s:g} s"))
        else:
            self._timer = self.loop.call_at(due_s, self._on_timer)

    def _name(self) -> str:
        return f"{self.pool.host}:{self.pool.port}"
