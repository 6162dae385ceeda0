"""A process served by ``serving.h1server.run`` settles its heap after start-up
(``serving.heap``): what the app built before serving is frozen out of the cyclic collector, so
no collection while it serves walks it. Checked in a real server process over loopback."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import weakref

import httpx
import pytest

from serving.heap import settle_heap

SERVER = textwrap.dedent("""
    import gc, json, socket
    from serving import ServerLimits
    from serving.h1server import H1Server, run
    from serving.limited_protocol import ConnectionTable

    START_UP = [[i] for i in range(50_000)]  # a large, long-lived start-up heap

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = json.dumps({"frozen": gc.get_freeze_count(),
                           "threshold": gc.get_threshold()}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    run(H1Server(app, ConnectionTable(ServerLimits()), lifespan=False), [sock],
        ready_line=f"listening on http://127.0.0.1:{port}", loop="asyncio")
""")


UVICORN_SERVER = SERVER.split("sock = socket.socket()")[0] + textwrap.dedent("""
    import asyncio, uvicorn
    from serving.draining_server import draining_server, listening_socket

    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def drain():
        pass

    config = uvicorn.Config(app, lifespan="off", log_level="warning", http="h11")
    draining_server(config, drain, f"listening on http://127.0.0.1:{port}").run(sockets=[sock])
""")


@pytest.mark.parametrize("server", [SERVER, UVICORN_SERVER], ids=["kvguard", "uvicorn"])
def test_the_start_up_heap_is_frozen_once_the_server_runs(server):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()  # the ready line (the process dies on a failure)
        assert line.startswith("listening on "), line
        state = httpx.get(line.split()[-1] + "/", timeout=30.0, trust_env=False).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert state["frozen"] >= 50_000  # the start-up objects, out of every collection
    assert state["threshold"] == list(gc.get_threshold())  # Python's thresholds, unchanged


class _Node:
    pass


def test_settle_heap_collects_then_freezes():
    node = _Node()
    node.me = node  # garbage only the cyclic collector can free
    gone = weakref.ref(node)
    del node
    kept = _Node()
    try:
        settle_heap()
        assert gone() is None  # collected before the freeze: garbage is not kept forever
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # the live heap: frozen, unwalked
    finally:
        gc.unfreeze()
