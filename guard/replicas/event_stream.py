"""One HTTP/1.1 ``text/event-stream`` response, read by an :class:`asyncio.Protocol`.

:class:`EventStreamProtocol` sends one request and parses what comes back as the loop hands
it over, in ``data_received``: the head (status line and headers), the body (chunked transfer
coding, or until the connection closes) and the server-sent events in it (``data:`` lines, an
event ending at a blank line); each event's ``data:`` payloads go to a callback there and
then. An event so costs one call from the loop's own read, where a ``StreamReader`` read by a
task cost a future, a task step and a coroutine resume per read: a guard in front of 256
replicas streaming at 10 Hz reads 2,560 events a second (issue #35).

The stream ends once, and :attr:`EventStreamProtocol.ended` (a future) then holds why, as an
exception object (its result, not raised: whoever awaits it decides), when

* the head is not ``200``: :class:`ConnectionError` (:attr:`~EventStreamProtocol.status`
  says which it was);
* the body ends (its last chunk, EOF, a reset): :class:`ConnectionError`;
* the bytes are not HTTP (a malformed head, a bad chunk size or framing): :class:`ValueError`;
* the callback raises: that exception;
* nothing came for too long: :class:`TimeoutError`. No head within ``head_timeout_s`` of
  the connection, or no byte for ``silent_after_s`` after it. One timer per stream keeps
  both: when it fires it compares the time of the latest bytes with the bound and, within
  it, is set again for those bytes plus the bound; bytes cost a clock reading, not a timer.

Ending aborts the connection. Nothing raises out of ``data_received`` into the loop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

__all__ = ["EventStreamProtocol"]

# asyncio.StreamReader's default limit, under which the head was read before this protocol
MAX_HEAD_BYTES = 65536
MAX_CHUNK_LINE_BYTES = 4096  # a chunk size line (hex digits and extensions) longer: not HTTP
_HEX = re.compile(rb"[0-9A-Fa-f]+")


class EventStreamProtocol(asyncio.Protocol):
    """Sends ``request`` once connected; ``on_open()`` at a ``200`` head, then
    ``on_event(payloads)`` for each event (the bytes after ``data: `` of each of its ``data:``
    lines; none for an event of comments only). :attr:`ended` resolves to why it ended."""

    def __init__(self, request: bytes, on_open: Callable[[], None],
                 on_event: Callable[[list[bytes]], None], *, head_timeout_s: float,
                 silent_after_s: float) -> None:
        self._request = request
        self._on_open = on_open
        self._on_event = on_event
        self._head_timeout_s = head_timeout_s
        self._silent_after_s = silent_after_s
        self._loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[BaseException] = self._loop.create_future()
        self.status: int | None = None  # the head's, once it came
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head = b""  # the head so far, until it is whole
        self._chunked = False
        self._raw = b""  # chunked: the bytes from the next chunk's size line on
        self._text = b""  # the event text after the latest blank line
        self._last_s = 0.0  # when the latest bytes came (the head's time bound before it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._last_s = self._loop.time()
        self._timer = self._loop.call_at(self._last_s + self._head_timeout_s, self._check)
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return
        try:
            if self.status is None:
                data = self._read_head(data)
                if self.ended.done() or self.status is None:
                    return
            self._last_s = self._loop.time()
            if self._chunked:
                data = self._dechunk(data)
            self._read_events(data)
        except Exception as exc:  # noqa: BLE001 - bad bytes or a failing callback: it ends
            self._end(exc)

    def eof_received(self) -> None:
        return None  # the transport closes; connection_lost says the stream ended

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None  # closed already: nothing to abort
        self._end(exc if exc is not None else ConnectionError("the stream ended"))

    def _read_head(self, data: bytes) -> bytes:
        """The body's bytes after the head; b"" until the head is whole."""
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                raise ValueError(f"no end of the head in {MAX_HEAD_BYTES} bytes")
            return b""
        head, body = self._head[:end], self._head[end + 4:]
        self._head = b""
        parts = head.split(b"\r\n", 1)[0].split(b" ", 2)  # version, code, reason
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") \
                or len(parts[1]) != 3 or not parts[1].isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {head[:80]!r}")
        self.status = int(parts[1])
        if self.status != 200:
            self._end(ConnectionError(f"answered {self.status}"))
            return b""
        self._chunked = b"transfer-encoding: chunked" in head.lower()
        self._timer.cancel()  # from now on: the silence bound
        self._timer = self._loop.call_at(self._loop.time() + self._silent_after_s, self._check)
        self._on_open()
        return body

    def _dechunk(self, data: bytes) -> bytes:
        """The payload of the whole chunks that ``data`` completes; what is left of a chunk
        waits for the next bytes. ConnectionError at the last chunk, ValueError at a bad size
        line or a chunk not followed by CRLF."""
        raw = self._raw + data if self._raw else data
        out = []
        while True:
            end = raw.find(b"\r\n")
            if end < 0:
                if len(raw) > MAX_CHUNK_LINE_BYTES:
                    raise ValueError(f"no chunk size line in {MAX_CHUNK_LINE_BYTES} bytes")
                break
            field = raw[:end].split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(field):
                raise ValueError(f"a bad chunk size line: {raw[:min(end, 80)]!r}")
            size = int(field, 16)
            if size == 0:
                raise ConnectionError("the stream ended (its last chunk)")
            stop = end + 2 + size
            if len(raw) < stop + 2:
                break
            if raw[stop:stop + 2] != b"\r\n":
                raise ValueError(f"a chunk of {size} bytes not followed by CRLF")
            out.append(raw[end + 2:stop])
            raw = raw[stop + 2:]
        self._raw = raw
        return b"".join(out)

    def _read_events(self, data: bytes) -> None:
        text = self._text + data if self._text else data
        *events, self._text = text.split(b"\n\n")
        for event in events:
            self._on_event([line[6:] for line in event.split(b"\n")
                            if line.startswith(b"data: ")])

    def _check(self) -> None:
        if self.status is None:
            self._end(TimeoutError(f"no head within {self._head_timeout_s:g} s"))
            return
        due_s = self._last_s + self._silent_after_s
        if self._loop.time() >= due_s:
            self._end(TimeoutError(f"no bytes for {self._silent_after_s:g} s"))
        else:
            self._timer = self._loop.call_at(due_s, self._check)

    def _end(self, why: BaseException) -> None:
        if not self.ended.done():
            self.ended.set_result(why)
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            self._transport.abort()
