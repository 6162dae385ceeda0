"""uvicorn in a thread on a free loopback port, for tests that need a real HTTP server.

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

__all__ = ["LoopbackServer"]


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
