"""Connection caps and the write deadline on a real server (in a thread, loopback) serving a
tiny app: uvicorn through ``serving.limited_protocol``, and kvguard's own ``serving.h1server``
(each test runs on both). Over a cap, a connection gets 503 and
is closed, and closing one frees its slot; a client that stops reading a long response is cut
and the app sees the disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from serving import ServerLimits
from serving.limited_protocol import ConnectionTable, uvicorn_config
from tests.support.loopback import H1LoopbackServer, LoopbackServer


class EndlessStream:
    """Streams 64 KiB chunks until the client goes away; records how it ended."""

    def __init__(self) -> None:
        self.num_chunks = 0
        self.ended = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        watcher = asyncio.ensure_future(receive())  # the request, then http.disconnect
        await watcher
        gone = asyncio.ensure_future(receive())
        try:
            while not gone.done() and self.num_chunks < 100_000:  # hang guard: 6.4 GB
                await send({"type": "http.response.body", "body": b"x" * 65536,
                            "more_body": True})
                self.num_chunks += 1
                await asyncio.sleep(0)
        finally:
            gone.cancel()
            self.ended.set()


@pytest.fixture(params=["uvicorn", "kvguard"])
def serve(request):
    with contextlib.ExitStack() as stack:
        def start(limits: ServerLimits, app=None):
            app = app or Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"))])
            table = ConnectionTable(limits)
            if request.param == "kvguard":
                server = stack.enter_context(H1LoopbackServer(app, table))
            else:
                server = stack.enter_context(LoopbackServer(
                    app, start_timeout_s=20.0,
                    make_config=lambda app, **options: uvicorn_config(app, table, **options)))
            return server.port, table

        yield start


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 30.0)
    writer.close()
    return answer


async def _hold_then_try(port: int, num_held: int) -> tuple[bytes, bytes]:
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(num_held)]
    await asyncio.sleep(0.1)  # the server has accepted them
    refused = await _get(port)
    held[0][1].close()
    await asyncio.sleep(0.3)  # ... and seen one of them go
    served = await _get(port)
    for _, writer in held[1:]:
        writer.close()
    return refused, served


@pytest.mark.parametrize("limits", [
    ServerLimits(header_timeout_s=60, max_connections_per_client=5),
    ServerLimits(header_timeout_s=60, max_connections=5),
])
def test_over_a_cap_is_503_then_a_freed_slot_serves(serve, limits):
    port, table = serve(limits)
    refused, served = asyncio.run(_hold_then_try(port, 5))
    assert refused.startswith(b"HTTP/1.1 503 "), refused
    assert b"retry-after: 1" in refused and b'"too_many_connections"' in refused
    assert served.startswith(b"HTTP/1.1 200 ") and served.endswith(b"ok"), served
    assert table.num_closed_by_reason["over_capacity"] == 1


def test_a_client_that_stops_reading_is_cut_after_the_write_timeout(serve):
    app = EndlessStream()
    port, table = serve(ServerLimits(write_timeout_s=1.0), app)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # ... and never read
    try:
        assert app.ended.wait(60.0), "the stream never ended"
    finally:
        sock.close()
    assert table.num_closed_by_reason["write_timeout"] == 1
    assert app.num_chunks < 100_000  # cut, not finished
