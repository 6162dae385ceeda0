"""How ``serving.h1server`` hands a response to its transport, over real loopback sockets: a
response with a ``content-length`` body (every shed is one) is one write — head and body in
one ``send`` syscall and one segment, not two — while a streamed (chunked) response's head goes
out as soon as the app starts it, before any body exists. A head held back for its body still
reaches the client when the app fails before sending the body."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving import ServerLimits
from serving.h1_connection import H1Connection
from serving.limited_protocol import ConnectionTable
from tests.support.loopback import H1LoopbackServer

SHED_BODY = b'{"error": {"message": "overloaded", "code": "slo_unattainable"}}'


class App:
    """``/shed``: a 503 with a content-length body; ``/stream``: a chunked stream whose first
    chunk is sent only once the test allows it; ``/boom``: a content-length head, then an
    error before the body."""

    def __init__(self, bad_header: tuple[bytes, bytes] | None = None) -> None:
        self.release_stream = threading.Event()
        self.bad_header = bad_header

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        path = scope["path"]
        if path == "/inject":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain"), self.bad_header]})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})
            return
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            while not self.release_stream.is_set():
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(SHED_BODY)).encode()),
                                (b"x-kvguard-reason", b"slo_unattainable")]})
        if path == "/boom":
            raise RuntimeError("boom after the head")
        await send({"type": "http.response.body", "body": SHED_BODY, "more_body": False})


@pytest.fixture
def writes(monkeypatch):
    """Every ``H1Connection.write`` (one ``transport.write`` each), in order."""
    seen: list[bytes] = []
    real = H1Connection.write

    def recording(self, data: bytes) -> None:
        seen.append(bytes(data))
        real(self, data)

    monkeypatch.setattr(H1Connection, "write", recording)
    return seen


def _server(app: App) -> H1LoopbackServer:
    return H1LoopbackServer(app, ConnectionTable(ServerLimits()))


async def _ask(port: int, path: str, *, until: bytes | None = None) -> tuple[bytes, object]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % path.encode())
    if until is not None:
        return await asyncio.wait_for(reader.readuntil(until), 30.0), writer
    data = await asyncio.wait_for(reader.read(), 30.0)
    writer.close()
    return data, None


async def _one_response(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /shed HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
    body = await asyncio.wait_for(reader.readexactly(len(SHED_BODY)), 30.0)
    writer.close()
    return head + body


def test_a_content_length_response_is_one_write(writes):
    with _server(App()) as srv:
        answer = asyncio.run(_one_response(srv.port))
    assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(SHED_BODY)
    assert writes == [answer]  # head and body together, once


def test_a_streamed_head_is_written_before_its_body_exists(writes):
    app = App()
    with _server(app) as srv:
        async def main() -> bytes:
            head, writer = await _ask(srv.port, "/stream", until=b"\r\n\r\n")
            app.release_stream.set()  # the body is sent only after the head was read
            writer.close()
            return head

        head = asyncio.run(main())
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
    assert writes[0] == head


def test_a_held_head_still_reaches_the_client_when_the_app_fails(writes):
    with _server(App()) as srv:
        answer, _ = asyncio.run(_ask(srv.port, "/boom"))  # read() returned: the server closed
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ") and body == b""


@pytest.mark.parametrize("bad_header", [
    (b"x-a", b"1\r\nset-cookie: injected=1"), (b"x-a", b"1\nset-cookie: injected=1"),
    (b"x-a", b"1\rset-cookie: injected=1"), (b"x-a\r\nset-cookie", b"injected=1"),
    (b"set-cookie: injected", b"1"),
])
def test_a_header_that_would_split_the_response_head_is_never_written(writes, bad_header):
    """An app's header with CR or LF in it, or a colon in its name, fails the response (500)
    instead of reaching the client as a header of its own."""
    with _server(App(bad_header)) as srv:
        answer, _ = asyncio.run(_ask(srv.port, "/inject"))
    assert answer.startswith(b"HTTP/1.1 500 ")
    assert b"injected" not in answer and not any(b"injected" in w for w in writes)
