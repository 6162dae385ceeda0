"""uvicorn (or kvguard's own ``H1Server``) in a thread on a free loopback port, for tests that
need a real HTTP server.

    with LoopbackServer(app) as server:
        httpx.get(server.url + "/health")

The server binds 127.0.0.1:0 itself (no port race), waits until uvicorn says it started (a hang
guard, not a timing assertion), and stops and joins its thread on exit.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["H1LoopbackServer", "LoopbackServer"]


class LoopbackServer:
    """``make_config(app, **options)`` builds the ``uvicorn.Config`` (default: uvicorn's own;
    e.g. ``serving.limited_protocol.uvicorn_config`` with its connection table bound)."""

    def __init__(self, app: Any, *, start_timeout_s: float = 10.0,
                 make_config: Callable[..., uvicorn.Config] = uvicorn.Config,
                 **config: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"log_level": "warning", "lifespan": "off", **config}
        self.server = uvicorn.Server(make_config(app, **options))
        self.server.install_signal_handlers = lambda: None  # the test process owns its signals
        self._start_timeout_s = start_timeout_s
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"uvicorn did not start within {self._start_timeout_s} s")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class H1LoopbackServer:
    """``serving.h1server.H1Server`` in a thread on a free loopback port (its own event loop),
    with ``table`` (a ``ConnectionTable``) holding its limits and counting its connections."""

    def __init__(self, app: Any, table: Any, *, start_timeout_s: float = 10.0,
                 graceful_timeout_s: float = 5.0) -> None:
        import asyncio

        from serving.h1server import H1Server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.table = table
        self.server = H1Server(app, table, graceful_timeout_s=graceful_timeout_s)
        self.loop = asyncio.new_event_loop()
        self._start_timeout_s = start_timeout_s
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Run ``coro`` on the server's loop and wait for its result (a hang guard)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> H1LoopbackServer:
        self.thread.start()
        if not self.call(self.server.start([self.sock]), self._start_timeout_s):
            raise RuntimeError("the app's lifespan startup failed")
        return self

    async def _finish(self) -> None:
        """Stop the server, then end what the app left running (no task is left to the GC)."""
        import asyncio

        if not self.server.draining:
            await self.server.stop()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self._finish())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()
            self.sock.close()


def serve_on(app: Any, server: str, **uvicorn_kwargs: Any) -> LoopbackServer | H1LoopbackServer:
    """``app`` on the named server: ``"kvguard"`` (kvguard's own, default limits) or a uvicorn
    HTTP implementation (``"h11"``, ``"httptools"``), for tests run on every server."""
    if server == "kvguard":
        from serving import ServerLimits
        from serving.limited_protocol import ConnectionTable
        return H1LoopbackServer(app, ConnectionTable(ServerLimits()))
    return LoopbackServer(app, http=server, **uvicorn_kwargs)
