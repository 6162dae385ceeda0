"""kvguard's own HTTP/1.1 server for ASGI apps, on asyncio protocols (``--http kvguard``).

uvicorn's per-request and per-chunk machinery (and its protocol classes under
``serving.limited_protocol``) cost most of what ``kvguard proxy`` added to a request (docs/
benchmarks.md §7). This server does the same job in one protocol class per connection
(``serving.h1_connection``), one request cycle at a time (``serving.h1_exchange``), with a
strict head parser (``serving.h1_head``):

* ASGI 3 ``http`` scopes (``lifespan`` too: startup before listening, shutdown at exit; an app
  that returns from ``lifespan`` without a word runs without it), ``http.request`` with the
  body (``Content-Length`` or chunked), ``http.disconnect`` as soon as the connection is lost;
* responses written as the app sends them: ``content-length`` when the app gives one, chunked
  otherwise (HTTP/1.0: until close), a ``date`` header, keep-alive unless either side says
  ``connection: close``;
* the ``ServerLimits`` and the ``ConnectionTable`` of ``serving.limited_protocol`` with the
  same semantics and close reasons;
* drain like ``serving.draining_server``: the first SIGINT/SIGTERM runs the owner's ``drain``
  coroutine (new connections still accepted meanwhile), then stops accepting, closes idle
  keep-alive connections, lets in-flight responses end for up to ``graceful_timeout_s``, runs
  the lifespan shutdown and returns; a second signal returns at once;
* connections waiting in the accept queue are accepted up to 64 per loop iteration, on
  uvloop too (``serving.acceptor``: libuv takes one per iteration);
* ``run`` settles the heap once the app has started (``serving.heap``): the start-up objects
  frozen out of the cyclic collector, young collections less often;
* an app may also offer ``http_direct(request, exchange)``: called from the read callback for
  each request whose head and body are in (``request`` the parsed ``serving.h1_head``
  ``RequestHead``, ``exchange`` the ``serving.h1_exchange.Exchange``: ``take_body()``,
  ``gone()``, ``send``, ``write_body``, ``respond``), before any scope or task exists. It
  returns None to leave the request to the ASGI app, True once it answered the request whole
  (``respond``: no task at all), or a coroutine: what is left to do, run as the request's task
  (first step at once); an exception is answered 500. It must not wait: it is how ``kvguard
  proxy`` decides and writes a request upstream, or sheds it, with no task in between.

No HTTP/2, no upgrades (WebSocket), no TLS: it serves ``kvguard proxy`` and ``kvguard engine``
on a trusted network edge or behind a load balancer.

    server = H1Server(app, ConnectionTable(limits))
    ok = run(server, [sock], drain=..., ready_line="... listening on ...", loop="auto")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any

from serving.acceptor import Acceptor
from serving.h1_connection import H1Connection
from serving.heap import settle_heap
from serving.limited_protocol import ConnectionTable

__all__ = ["H1Server", "event_loop_runner", "run"]

log = logging.getLogger("kvguard.http")


class H1Server:
    """Serves ``app`` on listening sockets; ``table`` holds the limits and counts connections.
    ``lifespan=False``: the app gets no ``lifespan`` scope."""

    def __init__(self, app: Any, table: ConnectionTable, *, graceful_timeout_s: float = 30.0,
                 lifespan: bool = True) -> None:
        self.app = app
        self.direct = getattr(app, "http_direct", None)  # see the module docstring
        self.use_lifespan = lifespan
        self.table = table
        self.graceful_timeout_s = graceful_timeout_s
        self.connections: set[H1Connection] = set()
        self.tasks: set[asyncio.Task] = set()  # the apps' request tasks
        self.lifespan_state: dict = {}
        self.draining = False
        self.started = False
        self.date_header = b""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.acceptors: list[Acceptor] = []
        self._lifespan: _Lifespan | None = None
        self._clock: asyncio.TimerHandle | None = None

    async def start(self, sockets: list[socket.socket]) -> bool:
        """Lifespan startup, then listen on ``sockets``; False when the app's startup failed."""
        self.loop = asyncio.get_running_loop()
        self._tick()
        if self.use_lifespan:
            self._lifespan = _Lifespan(self.app, self.lifespan_state)
        if self._lifespan is not None and not await self._lifespan.startup():
            self._stop_clock()
            return False
        for sock in sockets:  # up to 64 waiting connections per iteration (serving.acceptor)
            acceptor = Acceptor(self.loop, sock, lambda: H1Connection(self), backlog=2048)
            acceptor.start()
            self.acceptors.append(acceptor)
        self.started = True
        return True

    async def stop(self, force: Callable[[], bool] = lambda: False) -> None:
        """Stop accepting, close idle connections, let the others end (up to the graceful
        timeout, or until ``force()``), then the lifespan shutdown (skipped when forced)."""
        self.draining = True
        for acceptor in self.acceptors:
            acceptor.close()
        for connection in list(self.connections):
            connection.close_if_idle()
        deadline_s = time.monotonic() + self.graceful_timeout_s
        while self.connections and time.monotonic() < deadline_s and not force():
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.transport.abort()
        if self.tasks and not force():  # the apps see their disconnects and return
            await asyncio.wait(list(self.tasks), timeout=5.0)
        if self._lifespan is not None and not force():
            await self._lifespan.shutdown()
        self._stop_clock()

    def _tick(self) -> None:
        """The ``date`` header, rewritten once a second."""
        self.date_header = b"date: " + formatdate(usegmt=True).encode() + b"\r\n"
        self._clock = self.loop.call_later(1.0, self._tick)

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None


class _Lifespan:
    """The app's ``lifespan`` scope: startup before serving, shutdown after."""

    def __init__(self, app: Any, state: dict) -> None:
        self.app = app
        self.state = state
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._replies: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._spoken = False  # the app sent a lifespan message: it supports the protocol

    async def _main(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self.state}
        try:
            await self.app(scope, self._inbox.get, self._send)
        except Exception as exc:  # noqa: BLE001 - reported by startup/shutdown
            if self._spoken:
                log.error("Exception in the ASGI lifespan", exc_info=exc)
            await self._replies.put({"type": "error", "spoken": self._spoken})
        else:
            await self._replies.put({"type": "ended", "spoken": self._spoken})

    async def _send(self, message: dict) -> None:
        self._spoken = True
        await self._replies.put(message)

    async def startup(self) -> bool:
        self._task = asyncio.ensure_future(self._main())
        await self._inbox.put({"type": "lifespan.startup"})
        reply = await self._replies.get()
        if reply["type"] == "lifespan.startup.complete":
            return True
        if reply["type"] in ("error", "ended") and not reply["spoken"]:
            self._task = None  # lifespan not supported: serve without it
            return True
        if reply["type"] == "lifespan.startup.failed":
            log.error("Application startup failed: %s", reply.get("message", ""))
        elif reply["type"] != "error":
            log.error("Application startup failed: unexpected %r", reply["type"])
        return False

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        reply = await self._replies.get()
        if reply["type"] == "lifespan.shutdown.failed":
            log.error("Application shutdown failed: %s", reply.get("message", ""))
        await asyncio.wait([self._task], timeout=5.0)


def run(server: H1Server, sockets: list[socket.socket], *,
        drain: Callable[[], Awaitable[None]] | None = None, ready_line: str | None = None,
        loop: str = "auto") -> bool:
    """Serve until SIGINT/SIGTERM (see the module docstring); False when startup failed.
    ``loop``: ``asyncio``, ``uvloop``, or ``auto`` (uvloop when installed)."""
    return event_loop_runner(loop)(_serve(server, sockets, drain, ready_line))


async def _serve(server: H1Server, sockets: list[socket.socket],
                 drain: Callable[[], Awaitable[None]] | None, ready_line: str | None) -> bool:
    if not await server.start(sockets):
        return False
    settle_heap()  # the app's start-up heap, out of the collector's way (serving.heap)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    forced = False
    draining: list[asyncio.Future] = []

    async def drain_then_stop() -> None:
        try:
            if drain is not None:
                await drain()
        finally:
            stopping.set()

    def on_signal() -> None:
        nonlocal forced
        if draining:  # second signal: go now
            forced = True
            stopping.set()
            return
        draining.append(asyncio.ensure_future(drain_then_stop()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        if ready_line:
            print(ready_line, flush=True)
        await stopping.wait()
        await server.stop(force=lambda: forced)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in draining:
            task.cancel()
    return True


def event_loop_runner(loop: str) -> Callable[[Awaitable[bool]], bool]:
    if loop not in ("auto", "asyncio", "uvloop"):
        raise ValueError(f"loop must be auto, asyncio or uvloop, got {loop!r}")
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            return lambda main: _run_with(uvloop.new_event_loop, main)
    return lambda main: _run_with(asyncio.new_event_loop, main)


def _run_with(new_loop: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[bool]) -> bool:
    with contextlib.closing(new_loop()) as loop:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(main)
        finally:
            _cancel_all(loop)
            asyncio.set_event_loop(None)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
