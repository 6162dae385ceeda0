"""Trivial pass-through proxies: the floor ``kvguard bench proxy --floor`` measures kvguard against.

Three floors, each one process in front of one upstream, doing nothing but moving bytes:

* ``tcp``: an asyncio byte pump. Each client connection gets its own upstream connection and
  every byte read on one side is written to the other at once. No HTTP parsing at all: the cost
  of one more Python process and two more loopback hops in the path.
* ``asgi``: uvicorn + one aiohttp ``ClientSession`` (pooled keep-alive connections, as in
  ``kvguard proxy``). Every request is POSTed upstream as it came; the status, end-to-end headers
  and body chunks come back as they arrive. No admission, no routing, no bookkeeping: the cost of
  the HTTP stacks ``kvguard proxy`` is built on (``--loop``/``--http`` pick uvicorn's).
* ``http``: HTTP/1.1 on raw asyncio protocols, no ASGI server and no client library. The
  request head is parsed and re-framed (hop-by-hop headers dropped, ``host`` and
  ``content-length`` set) onto a pooled keep-alive upstream connection; the response head is
  parsed and re-written, and the body bytes go to the client as they arrive while their framing
  (``content-length`` or chunked) is followed to find the end. One request at a time per
  connection (no pipelining), no timeouts, no limits: a measure of what HTTP handling in Python
  costs without the stacks, not a server to deploy.

    python -m chaos.passthrough --mode asgi --upstream http://127.0.0.1:8001 --port 0

prints ``passthrough listening on http://HOST:PORT`` once it accepts connections and runs until
SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any
from urllib.parse import urlsplit

from chaos.bench.raw_http_relay import HttpRelay
from guard.proxy.upstream_contract import HOP_BY_HOP

__all__ = ["PassthroughApp", "TcpPump", "HttpRelay", "main"]

# the proxy's hop-by-hop set, plus what this process's own server writes on every response
_HOP_BY_HOP = HOP_BY_HOP | {b"date", b"server"}
_READY = "passthrough listening on {url}"


class PassthroughApp:
    """ASGI app relaying every request to ``upstream`` over one pooled aiohttp session."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream.rstrip("/")
        self._session: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]
                   if n not in _HOP_BY_HOP]
        async with self._session.request(scope["method"], self._upstream + scope["path"],
                                         data=body, headers=headers) as response:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(n.lower(), v) for n, v in response.raw_headers
                                    if n.lower() not in _HOP_BY_HOP]})
            while chunk := await response.content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        import aiohttp

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = aiohttp.ClientSession(
                    auto_decompress=False, trust_env=False,
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Pipe(asyncio.Protocol):
    """One side of a pumped connection: what it reads goes to ``peer`` unchanged."""

    def __init__(self, peer: asyncio.Transport | None = None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # client bytes read before the upstream connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class TcpPump:
    """A byte pump from every accepted connection to its own connection to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port

    def __call__(self) -> asyncio.Protocol:
        client = _Pipe()
        asyncio.get_running_loop().create_task(self._connect(client))
        return client

    async def _connect(self, client: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream_transport, _ = await loop.create_connection(
                lambda: _Pipe(client.transport), self._host, self._port)
        except OSError:
            client.transport.close()
            return
        client.peer = upstream_transport
        for data in client.pending:
            upstream_transport.write(data)
        client.pending.clear()


async def _serve_raw(mode: str, upstream: str, host: str, port: int) -> None:
    from serving.draining_server import listening_socket

    parts = urlsplit(upstream)
    factory = TcpPump if mode == "tcp" else HttpRelay
    sock = listening_socket(host, port)
    server = await asyncio.get_running_loop().create_server(
        factory(parts.hostname, parts.port or 80), sock=sock)
    bound_host, bound_port = sock.getsockname()[:2]
    print(_READY.format(url=f"http://{bound_host}:{bound_port}"), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _serve_asgi(upstream: str, host: str, port: int, loop: str, http: str) -> None:
    import uvicorn

    from serving.draining_server import listening_socket

    sock = listening_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn.Config(PassthroughApp(upstream), loop=loop, http=http, lifespan="on",
                            log_level="warning", access_log=False)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(_READY.format(url=f"http://{bound_host}:{bound_port}"), flush=True)

    Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.passthrough", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("tcp", "http", "asgi"), required=True)
    parser.add_argument("--upstream", required=True, help="http://HOST:PORT of the one upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--http", choices=("h11", "httptools"), default="h11")
    args = parser.parse_args(argv)
    if urlsplit(args.upstream).scheme != "http" or not urlsplit(args.upstream).hostname:
        parser.error(f"--upstream: expected http://HOST:PORT, got {args.upstream!r}")
    if args.mode in ("tcp", "http"):
        asyncio.run(_serve_raw(args.mode, args.upstream, args.host, args.port))
    else:
        _serve_asgi(args.upstream, args.host, args.port, args.loop, args.http)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
