"""Accepting the connections that wait, many per loop iteration, on asyncio's loop and on
uvloop alike.

libuv accepts one connection per event-loop iteration (since libuv 1.45, "unix: don't
accept() connections in a loop"; uvloop bundles it). A server whose iterations are long — a
proxy shedding a flood — then leaves new connections in the kernel's accept queue for one
iteration each, so a burst of connections waits many iterations (docs/benchmarks.md §7 has
the measurement). New connections come in bursts exactly when a service is overloaded:
clients that time out retry on fresh ones.

:class:`Acceptor` reads the listening socket itself: each time it is readable it accepts up to
``batch`` (64) waiting connections — the rest stay readable, so the next iteration goes on;
a burst is taken in steps between the loop's other work, not in one long iteration — gives
each ``TCP_NODELAY`` and hands it to the loop's ``connect_accepted_socket`` (which owns it
from then on). Out of file descriptors (``EMFILE`` and kin), or on any other accept error, it
stops reading the listener for a second, as asyncio's own server does for those, and logs it;
a connection reset before it was accepted is skipped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

from serving.eager_task import start_eagerly

__all__ = ["Acceptor"]

log = logging.getLogger("kvguard.http")

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_AFTER_S = 1.0  # asyncio's own pause after EMFILE


class Acceptor:
    """Accepts connections on ``sock`` (bound; listened on by :meth:`start`) into
    ``protocol_factory()`` protocols."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol_factory: Callable[[], asyncio.Protocol], backlog: int = 2048,
                 batch: int = 64) -> None:
        if backlog < 1 or batch < 1:
            raise ValueError(f"backlog and batch must be >= 1, got {backlog} and {batch}")
        self.loop = loop
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.backlog = backlog
        self.batch = batch
        self.num_accepted = 0
        self._reading = False
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._starting: set[asyncio.Task] = set()  # connect_accepted_socket still running

    def start(self) -> None:
        self.sock.setblocking(False)
        self.sock.listen(self.backlog)
        self._read()

    def close(self) -> None:
        """Stop accepting and close the listening socket (accepted connections stay)."""
        if self._closed:
            return
        self._closed = True
        self._unread()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self.sock.close()

    def _read(self) -> None:
        if not self._closed and not self._reading:
            self.loop.add_reader(self.sock.fileno(), self._ready)
            self._reading = True

    def _unread(self) -> None:
        if self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False

    def _resume(self) -> None:
        self._retry = None
        self._read()

    def _ready(self) -> None:
        for _ in range(self.batch):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left
            except ConnectionAbortedError:
                continue  # reset by the client while it waited
            except OSError as exc:  # EMFILE and kin, or anything else: pause, never spin
                if exc.errno in _OUT_OF_RESOURCES:
                    log.error("accept() on %s: %s; accepting again in %g s",
                              self.sock.getsockname(), exc.strerror, RETRY_AFTER_S)
                else:
                    log.error("accept() on %s failed: %r; accepting again in %g s",
                              self.sock.getsockname(), exc, RETRY_AFTER_S)
                self._unread()
                self._retry = self.loop.call_later(RETRY_AFTER_S, self._resume)
                return
            self.num_accepted += 1
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # gone already
                conn.close()
                continue
            # its transport is made now, in this iteration (serving.eager_task), not the next
            task = start_eagerly(self.loop, self._connect(conn))
            self._starting.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self._starting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn)
        except Exception as exc:  # noqa: BLE001 - one connection's failure, not the server's
            log.debug("accepted connection dropped before it started: %r", exc)
            conn.close()
