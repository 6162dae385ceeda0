"""The listening socket and the drain-first uvicorn server shared by ``kvguard engine`` and
``kvguard proxy``.

``listening_socket`` makes the socket with ``IPPROTO_TCP`` (asyncio sets ``TCP_NODELAY`` on
accepted connections only then; protocol 0 leaves Nagle on and stalls streamed responses).
``draining_server`` is a ``uvicorn.Server`` whose first SIGINT/SIGTERM runs the owner's
``drain`` coroutine and then exits; a second signal exits at once. It prints ``ready_line``
once the server listens, after settling the start-up heap (``serving.heap``), as kvguard's own
server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable

from serving.heap import settle_heap

__all__ = ["draining_server", "listening_socket"]


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def draining_server(config, drain: Callable[[], Awaitable[None]], ready_line: str):
    """A uvicorn server for ``config`` that runs ``drain()`` before exiting on a signal."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self._drain: asyncio.Task | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def _on_signal(self) -> None:
            if self._drain is not None:  # second signal: go now
                self.should_exit = self.force_exit = True
                return
            self._drain = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await drain()
            finally:
                self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                settle_heap()  # the app's start-up heap, out of the collector's way
                print(ready_line, flush=True)

    return DrainingServer()
