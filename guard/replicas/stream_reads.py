"""The state streams' sockets, read in rounds instead of as their bytes arrive.

A guard in front of 256 replicas streaming their state at 10 Hz receives 2,560 events a
second, each on its own connection at its own instant. Read by the event loop, every event is
a wake-up of the process: a context switch, a turn of the loop, and the ingest's code and data
cold in the caches each time. Measured in a real proxy in front of 256 state-only replicas
(issue #35), 65 µs of CPU an event, of which ~20 went once the reads piled up for 5 ms and
were taken in one turn.

:class:`StreamReads` (one per event loop: :func:`stream_reads`) keeps the streams' sockets
out of the loop's own poll, in a selector of its own, and reads every socket that has bytes
waiting once a round: a timer every ``period_s`` (:data:`READ_ROUND_S`, 5 ms, or
:data:`READ_ROUND_FRACTION` of a stream's interval where that is shorter: the shortest any
open stream asked for), armed while it holds a socket. An event is so read at most one round
after its bytes arrived, and the events of a round are handled back to back. The requests
the proxy serves do not wait on it: their sockets stay in the loop's own poll.

:meth:`StreamReads.create_connection` connects as ``loop.create_connection`` does and hands
the protocol a :class:`RoundTransport`, which reads for it (``data_received``,
``eof_received`` then ``connection_lost``) and writes the one request a stream sends: it must
go at once (on a connection just made the send buffer is empty), or the connection is lost
with a ConnectionError. A connection the kernel made to itself (:mod:`guard.self_connect`) is
refused, as the guard's other clients refuse one.
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import weakref
from collections.abc import Callable
from typing import Any

from guard.self_connect import reset_on_close, socket_connected_to_itself

__all__ = ["READ_ROUND_FRACTION", "READ_ROUND_S", "RoundTransport", "StreamReads",
           "read_round_s", "stream_reads"]

READ_ROUND_S = 0.005  # a round of reads at most this long after the one before
READ_ROUND_FRACTION = 0.05  # and at most this fraction of a stream's interval after it
MAX_READ_BYTES = 262144  # one read per socket per round; what is left waits for the next

_READS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamReads] = \
    weakref.WeakKeyDictionary()


def read_round_s(interval_s: float) -> float:
    """The round a stream sending every ``interval_s`` asks for."""
    return min(READ_ROUND_S, interval_s * READ_ROUND_FRACTION)


def stream_reads() -> StreamReads:
    """The running loop's :class:`StreamReads`, made on first use."""
    loop = asyncio.get_running_loop()
    reads = _READS.get(loop)
    if reads is None:
        reads = _READS[loop] = StreamReads(loop)
    return reads


class RoundTransport(asyncio.Transport):
    """One stream's connection, read by its :class:`StreamReads` in rounds."""

    def __init__(self, reads: StreamReads, sock: socket.socket, protocol: asyncio.Protocol,
                 period_s: float) -> None:
        super().__init__()
        self._reads = reads
        self._sock = sock
        self._protocol = protocol
        self.period_s = period_s
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock if name == "socket" else default

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: bytes) -> None:
        """Send ``data`` now, whole (a stream's request), or lose the connection."""
        if self._closing:
            return
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._lose(exc)
            return
        if sent < len(data):
            self._lose(ConnectionError(f"{len(data) - sent} of the request's {len(data)} "
                                       "bytes did not fit the socket's send buffer"))

    def abort(self) -> None:
        self._lose(None)

    def close(self) -> None:
        self._lose(None)

    def read(self) -> None:
        """The round's read (the socket had bytes, an EOF or an error waiting)."""
        if self._closing:  # lost earlier in the same round
            return
        try:
            data = self._sock.recv(MAX_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        try:
            if data:
                self._protocol.data_received(data)
                return
            self._protocol.eof_received()
        except Exception as exc:  # noqa: BLE001 - a protocol's bug ends its connection only
            self._reads.loop.call_exception_handler({
                "message": "a stream protocol failed on its bytes", "exception": exc,
                "transport": self, "protocol": self._protocol})
            self._lose(exc)
            return
        self._lose(None)

    def _lose(self, exc: BaseException | None) -> None:
        """Closed once: out of the rounds, the socket closed, and the protocol told on the
        loop's next turn (as an asyncio transport tells it)."""
        if self._closing:
            return
        self._closing = True
        self._reads.remove(self)
        self._sock.close()
        self._reads.loop.call_soon(self._protocol.connection_lost, exc)


class StreamReads:
    """The sockets of one loop's streams and the timer that reads them (module docstring):
    a round at least every ``period_s``, sooner where a stream asks for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float = READ_ROUND_S) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.loop = loop
        self._selector: selectors.BaseSelector | None = None  # while it holds a socket
        self._transports: set[RoundTransport] = set()
        self._longest_s = period_s  # between rounds, whatever the streams ask
        self._period_s = period_s
        self._timer: asyncio.TimerHandle | None = None
        self.num_rounds = 0
        self.num_reads = 0

    def __len__(self) -> int:
        return len(self._transports)

    @property
    def period_s(self) -> float:
        """The time between rounds now."""
        return self._period_s

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol],
                                host: str, port: int, *, period_s: float = READ_ROUND_S
                                ) -> tuple[RoundTransport, asyncio.Protocol]:
        """Connect to ``host``:``port`` (each address it resolves to in turn, the first that
        answers) and read the connection in rounds no further apart than ``period_s``. The
        errors of ``loop.create_connection``: OSError when no address answers,
        ConnectionRefusedError for a connection made to itself."""
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        errors: list[OSError] = []
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await self.loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                errors.append(exc)
                continue
            except BaseException:
                sock.close()
                raise
            if socket_connected_to_itself(sock):
                reset_on_close(sock)  # nothing left on the port the replica would bind
                sock.close()
                raise ConnectionRefusedError(f"{host}:{port}: the connection reached itself")
            break
        else:
            if len(errors) == 1:
                raise errors[0]
            raise OSError(f"{host}:{port}: no address answered: "
                          + "; ".join(str(e) for e in errors))
        protocol = protocol_factory()
        transport = RoundTransport(self, sock, protocol, period_s)
        self._add(transport)
        protocol.connection_made(transport)
        return transport, protocol

    def _add(self, transport: RoundTransport) -> None:
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
        self._selector.register(transport.get_extra_info("socket"), selectors.EVENT_READ,
                                transport)
        self._transports.add(transport)
        if transport.period_s < self._period_s:
            self._period_s = transport.period_s
            if self._timer is not None:  # sooner now
                self._timer.cancel()
                self._timer = None
        if self._timer is None:
            self._timer = self.loop.call_later(self._period_s, self._round)

    def remove(self, transport: RoundTransport) -> None:
        """``transport`` is no longer read (its socket is about to close)."""
        if transport not in self._transports:
            return
        self._transports.discard(transport)
        assert self._selector is not None
        self._selector.unregister(transport.get_extra_info("socket"))
        if not self._transports:  # nothing to read: no timer, no selector
            self._selector.close()
            self._selector = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._period_s = self._longest_s
        elif transport.period_s == self._period_s:
            self._period_s = min(self._longest_s, *(t.period_s for t in self._transports))

    def _round(self) -> None:
        """Read every socket with bytes waiting, once; then the next round."""
        self._timer = None  # armed only while a socket is held: the selector is there
        self.num_rounds += 1
        for key, _ in self._selector.select(0):  # type: ignore[union-attr]
            self.num_reads += 1
            key.data.read()
        if self._transports and self._timer is None:
            self._timer = self.loop.call_later(self._period_s, self._round)
