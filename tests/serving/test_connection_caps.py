"""Connection caps on a real uvicorn server (in a thread, loopback) serving a tiny Starlette
app through ``serving.limited_protocol``: over a cap, a connection gets 503 and is closed;
closing one frees its slot."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from serving import ServerLimits
from serving.limited_protocol import ConnectionTable, uvicorn_config


@pytest.fixture()
def serve():
    servers = []

    def start(limits: ServerLimits):
        import uvicorn

        app = Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"))])
        table = ConnectionTable(limits)
        server = uvicorn.Server(uvicorn_config(app, table, log_level="warning", lifespan="off"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        for _ in range(400):  # hang guard: 20 s
            if server.started:
                break
            threading.Event().wait(0.05)
        assert server.started
        return sock.getsockname()[1], table

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


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
