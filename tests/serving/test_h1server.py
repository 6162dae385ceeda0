"""kvguard's own HTTP/1.1 server (``serving.h1server``) over real loopback sockets: malformed
and smuggling heads are answered 400/431/505 and never reach the app; bodies (content-length,
chunked, split across writes, 100-continue); keep-alive reuse, ``connection: close``, HTTP/1.0,
pipelining; ``http.disconnect`` on a client that leaves mid-stream; slow clients cut by the
limits; app errors; lifespan; drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from serving import ServerLimits
from serving.limited_protocol import ConnectionTable
from tests.support.loopback import H1LoopbackServer
from tests.support.slow_clients import TRICKLE_FOR_S, slowloris


class Recorder:
    """Echo app: answers ``{"method", "path", "query", "body", "client"}`` as JSON, with the
    body read message by message; records every request it saw and how each ended."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.lifespan: list[str] = []
        self.disconnected = threading.Event()
        self.events: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                if message["type"] == "lifespan.startup":
                    scope["state"]["greeting"] = "hi"
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.requests.append(scope)
        path = scope["path"]
        self.events.append("start " + path)
        if path == "/boom":
            raise RuntimeError("boom before the response")
        if path == "/stream":
            return await self._stream(receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            chunks.append(message["body"])
            if not message["more_body"]:
                break
        body = json.dumps({"method": scope["method"], "path": path,
                           "query": scope["query_string"].decode(),
                           "body": b"".join(chunks).decode(), "client": list(scope["client"]),
                           "state": scope["state"].get("greeting"),
                           "num_messages": len(chunks)}).encode()
        headers = [(b"content-type", b"application/json")]
        if path != "/chunked":
            headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if path == "/after-start-boom":
            raise RuntimeError("boom after the response started")
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.events.append("end " + path)

    async def _stream(self, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        message = await receive()  # the next message can only be the disconnect
        if message["type"] == "http.disconnect":
            self.disconnected.set()


@pytest.fixture()
def server():
    with contextlib.ExitStack() as stack:
        def start(app=None, limits: ServerLimits | None = None) -> H1LoopbackServer:
            table = ConnectionTable(limits or ServerLimits())
            return stack.enter_context(H1LoopbackServer(app or Recorder(), table))

        yield start


async def _exchange(port: int, raw: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), 30.0)
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
    finally:
        writer.close()


def _send(port: int, raw: bytes) -> bytes:
    return asyncio.run(_exchange(port, raw))


BAD_HEADS = [
    (b"GARBAGE / NOT-HTTP\r\n\r\n", 400),
    (b"GET  / HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # two spaces
    (b"GET foo HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # not a path
    (b"GET /a\x01b HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    (b"G(T / HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # method not a token
    (b"CONNECT x:443 HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no host
    (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost : x\r\n\r\n", 400),  # whitespace before the colon
    (b"GET / HTTP/1.1\r\nhost: x\r\nno-colon\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n  folded\r\n\r\n", 400),  # obs-fold
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: x\nx-a: b\r\n\r\n", 400),  # bare LF
    (b"GET / HTTP/1.1\r\nhost: x\rx-a: b\r\n\r\n", 400),  # bare CR
    # request smuggling: both framings, an obfuscated or repeated TE, conflicting lengths
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
     b"transfer-encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: +3\r\n\r\nabc", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3, 3\r\n\r\nabc", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1e3\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-a: b\r\n" * 101 + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
]


@pytest.mark.parametrize("raw,status", BAD_HEADS, ids=range(len(BAD_HEADS)))
def test_malformed_heads_are_refused_and_never_reach_the_app(server, raw, status):
    srv = server()
    answer = _send(srv.port, raw)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer
    assert b"connection: close" in answer and b'"error"' in answer
    assert srv.server.app.requests == []
    # the server is fine afterwards
    assert httpx.get(srv.url + "/ok", trust_env=False).json()["path"] == "/ok"


def test_a_smuggled_second_request_is_not_served(server):
    """CL.TE: with both headers the whole message is refused, so the "body" that would be a
    second request for a server that trusted the other header never runs."""
    srv = server()
    answer = _send(srv.port, b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 35\r\n"
                             b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                             b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1") == 1
    assert srv.server.app.requests == []


def test_scope_and_content_length_body_split_across_writes(server):
    srv = server()

    async def main() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /a%20b/c?x=1&y=%20 HTTP/1.1\r\nHost: x\r\nX-Up: V\r\n"
                     b"content-length: 10\r\n\r\nhel")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"lo worl")
        writer.write(b"d")  # never read: past the content-length
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), 30.0)
        writer.close()
        return body

    answer = json.loads(asyncio.run(main()))
    assert answer["body"] == "hello worl" and answer["query"] == "x=1&y=%20"
    assert answer["path"] == "/a b/c" and answer["state"] == "hi"
    scope = srv.server.app.requests[0]
    assert scope["raw_path"] == b"/a%20b/c" and scope["http_version"] == "1.1"
    assert scope["scheme"] == "http" and scope["root_path"] == ""
    assert scope["server"] == ("127.0.0.1", srv.port)
    assert scope["asgi"]["version"] == "3.0"
    assert (b"x-up", b"V") in scope["headers"] and (b"host", b"x") in scope["headers"]


def test_chunked_request_body_with_extensions_and_trailers(server):
    srv = server()
    answer = _send(srv.port, b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: Chunked\r\n"
                             b"connection: close\r\n\r\n5;ext=1\r\nhello\r\n1\r\n \r\n"
                             b"5\r\nworld\r\n0\r\nx-trailer: t\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head
    assert json.loads(body)["body"] == "hello world"


@pytest.mark.parametrize("bad_chunk", [b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX0\r\n\r\n",
                                       b"-5\r\nhello\r\n0\r\n\r\n"])
def test_malformed_chunked_body_is_400_and_the_app_sees_a_disconnect(server, bad_chunk):
    srv = server()
    answer = _send(srv.port, b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                             b"\r\n" + bad_chunk)
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert srv.server.app.disconnected.wait(30.0)


def test_keep_alive_reuses_one_connection_and_close_ends_it(server):
    srv = server()
    with httpx.Client(base_url=srv.url, trust_env=False) as client:
        answers = [client.post("/k", content=b"x" * i).json() for i in range(5)]
        closed = client.get("/last", headers={"connection": "close"})
    assert [a["body"] for a in answers] == ["x" * i for i in range(5)]
    assert len({tuple(a["client"]) for a in answers}) == 1  # one connection
    assert closed.headers["connection"] == "close"


def _answer(sock: socket.socket) -> bytes:
    """One whole response of the Recorder (it always sends content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the connection closed before the response: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "the connection closed inside the response"
        body += more
    return head


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False


def test_the_keep_alive_deadline_counts_from_the_last_response(server):
    """Deadlines are lazy (one timer per connection, set again when it finds the phase's due
    time ahead): a connection kept busy past its first keep-alive window stays open, and is
    closed once it idles a whole window after its last response."""
    srv = server(limits=ServerLimits(header_timeout_s=1.0, keep_alive_timeout_s=3.0))
    request = b"GET /k HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.settimeout(30.0)
        for _ in range(3):  # 4.8 s in all: past the first request's window
            sock.sendall(request)
            assert _answer(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.6)
        assert _closed_within(sock, 30.0)  # idle a whole window: closed
    assert len(srv.server.app.requests) == 3


def test_a_head_deadline_nearer_than_the_running_timer_replaces_it(server):
    """A keep-alive window far longer than the header timeout: the next request's head that
    stalls is still cut at the header timeout (counted), not when the idle timer would fire."""
    srv = server(limits=ServerLimits(header_timeout_s=0.5, keep_alive_timeout_s=60.0))
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.settimeout(30.0)
        sock.sendall(b"GET /k HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.0)  # the connection's first timer (its first head's) has run by now
        sock.sendall(b"GET /k HTTP/1.1\r\n")  # and nothing more
        assert _closed_within(sock, 30.0)
    assert srv.table.num_closed_by_reason["header_timeout"] == 1


def test_http10_is_closed_after_the_response_unless_keep_alive(server):
    srv = server()
    answer = _send(srv.port, b"GET /chunked HTTP/1.0\r\n\r\n")  # no content-length: until close
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head
    assert b"connection: close" in head and json.loads(body)["path"] == "/chunked"
    kept = asyncio.run(_exchange(srv.port, b"GET /k HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
                                 read_until_close=False))
    assert b"connection: keep-alive" in kept


def test_pipelined_requests_are_answered_in_order_one_at_a_time(server):
    srv = server()
    answer = _send(srv.port, b"GET /one HTTP/1.1\r\nhost: x\r\n\r\n"
                             b"POST /two HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
                             b"GET /three HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 ") == 3
    assert answer.index(b'"/one"') < answer.index(b'"/two"') < answer.index(b'"/three"')
    assert srv.server.app.events == ["start /one", "end /one", "start /two", "end /two",
                                     "start /three", "end /three"]


def test_chunked_response_when_the_app_gives_no_length(server):
    srv = server()
    with httpx.Client(base_url=srv.url, trust_env=False) as client:
        response = client.get("/chunked")
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.json()["path"] == "/chunked"


def test_expect_100_continue_then_the_body(server):
    srv = server()

    async def main() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
                     b"expect: 100-continue\r\nconnection: close\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
        writer.write(b"abc")
        rest = await asyncio.wait_for(reader.read(), 30.0)
        writer.close()
        return interim, rest

    interim, rest = asyncio.run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["body"] == "abc"


def test_head_request_gets_no_body(server):
    srv = server()
    answer = _send(srv.port, b"HEAD /h HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and body == b""


def test_client_leaving_mid_stream_is_a_prompt_disconnect(server):
    srv = server()

    async def main() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n"), 30.0)
        writer.close()

    asyncio.run(main())
    assert srv.server.app.disconnected.wait(30.0)  # hang guard: the app is never woken else
    assert srv.call(_num_connections(srv)) == 0


async def _num_connections(srv) -> int:
    return len(srv.server.connections)


def test_app_error_before_the_response_is_500_json(server):
    srv = server()
    answer = _send(srv.port, b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 500 ") and b"connection: close" in head
    assert json.loads(body)["error"]["type"] == "server_error"


def test_app_error_after_the_response_started_closes_the_connection(server):
    srv = server()
    answer = _send(srv.port, b"GET /after-start-boom HTTP/1.1\r\nhost: x\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)  # read() returned: the server closed
    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
    assert head.startswith(b"HTTP/1.1 200 ") and len(body) < length


def test_lifespan_runs_around_serving_and_the_state_reaches_requests(server):
    app = Recorder()
    srv = server(app)
    assert app.lifespan == ["lifespan.startup"]
    assert httpx.get(srv.url + "/s", trust_env=False).json()["state"] == "hi"
    srv.call(srv.server.stop())
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def test_a_failed_startup_does_not_listen():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no"})

    srv = H1LoopbackServer(app, ConnectionTable(ServerLimits()))
    with pytest.raises(RuntimeError, match="startup failed"), srv:
        pass
    assert not srv.server.started


def test_stop_closes_idle_connections_and_lets_a_response_finish(server):
    release = threading.Event()

    async def slow(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        while not release.is_set():  # bounded by the test's own hang guard below
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"b", "more_body": False})

    srv = server(slow)
    idle = socket.create_connection(("127.0.0.1", srv.port))
    busy = socket.create_connection(("127.0.0.1", srv.port))
    busy.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert busy.recv(4096).startswith(b"HTTP/1.1 200 ")
    stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(), srv.loop)
    idle.settimeout(30.0)
    assert idle.recv(1) == b""  # closed by the drain
    release.set()
    busy.settimeout(30.0)
    rest = b""
    while chunk := busy.recv(4096):
        rest += chunk
    assert rest.endswith(b"1\r\nb\r\n0\r\n\r\n")  # finished, then closed
    stopping.result(30.0)
    idle.close()
    busy.close()


@pytest.mark.slow
def test_slow_clients_are_cut_while_a_probe_is_served(server):
    srv = server(limits=ServerLimits(header_timeout_s=2, body_timeout_s=2,
                                     keep_alive_timeout_s=2))
    srv.server.app.requests.clear()
    closed_after_s, probe, _ = asyncio.run(slowloris(srv.url, "/v1/completions", {"a": 1}))
    assert probe.status_code == 200 and json.loads(probe.json()["body"]) == {"a": 1}
    never_cut = [i for i, t in enumerate(closed_after_s) if t is None]
    assert not never_cut, f"connections still open after {TRICKLE_FOR_S} s: {never_cut}"
    closed = srv.table.num_closed_by_reason
    assert closed["header_timeout"] >= 25 and closed["body_timeout"] >= 15, closed
    assert srv.table.num_open == 0 or srv.call(_num_connections(srv)) == srv.table.num_open


def test_two_waiting_receives_both_see_the_disconnect(server):
    """The proxy reads the body and watches for the disconnect with separate receive() calls;
    each waiting one must be woken."""
    woken: list[str] = []
    done = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()  # the (empty) body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        first, second = await asyncio.gather(receive(), receive())
        woken.extend([first["type"], second["type"]])
        done.set()

    srv = server(app)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert done.wait(30.0)
    assert woken == ["http.disconnect", "http.disconnect"]


def test_a_body_the_app_does_not_read_yet_is_not_buffered_without_bound(server):
    """The client sends 16 MiB while the app holds off reading: the server stops reading
    (TCP pushes back on the client) instead of buffering it all; then the app gets every byte."""
    go = threading.Event()
    seen: list[int] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while not go.is_set():  # bounded by the test's own hang guard below
            await asyncio.sleep(0.01)
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen.append(size)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    srv = server(app)
    total = 16 * 1024 * 1024
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sender = threading.Thread(target=sock.sendall, args=(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % total + b"x" * total,),
        daemon=True)
    sender.start()
    sender.join(1.0)  # it blocks: the server stopped reading
    assert sender.is_alive()
    buffered = srv.call(_num_buffered(srv))
    assert buffered <= 1024 * 1024, buffered  # 256 KiB mark + at most a few reads
    go.set()
    sender.join(30.0)
    sock.settimeout(30.0)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    sock.close()
    assert seen == [total]


async def _num_buffered(srv) -> int:
    return sum(len(c._buffer) + (c.exchange.num_buffered if c.exchange else 0)
               for c in srv.server.connections)


@pytest.mark.parametrize("headers", [[(b"x-a", b"b\r\nset-cookie: injected")],
                                     [(b"content-length", b"nope")]])
def test_a_response_head_the_app_gets_wrong_is_a_500_not_an_injection(server, headers):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    srv = server(app)
    answer = _send(srv.port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500 ") and b"injected" not in answer, answer


def test_the_disconnect_future_completes_when_the_client_leaves_mid_response(server):
    """``kvguard.disconnect`` in the scope: one future per request, done once the client left
    before the response ended (and not for a response that ended first)."""
    seen: dict[str, object] = {}
    done = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        gone = scope["extensions"]["kvguard.disconnect"]["future"]
        assert gone() is gone()
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/whole":
            await send({"type": "http.response.body", "body": b"x", "more_body": False})
            seen["whole"] = gone().done()
            return
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        seen["message"] = await asyncio.wait_for(gone(), 30.0)
        done.set()

    srv = server(app)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET /whole HTTP/1.1\r\nhost: x\r\n\r\n")
        assert b"\r\n\r\n" in sock.recv(4096)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert done.wait(30.0)
    assert seen == {"whole": False, "message": {"type": "http.disconnect"}}


def test_an_app_started_from_the_read_callback_runs_in_its_task_and_sees_the_disconnect(server):
    """The app's first step runs at once from the connection's read callback
    (``serving.eager_task``), inside the request's task: ``asyncio.timeout`` works there, and a
    client that leaves before sending the body it announced is ``http.disconnect``."""
    seen: dict[str, object] = {}
    done = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen["task"] = asyncio.current_task() is not None
        async with asyncio.timeout(30):  # raises RuntimeError outside a task
            message = await receive()
            while message["type"] == "http.request":  # the rest of the body never comes
                message = await receive()
        seen["message"] = message
        done.set()

    srv = server(app)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        sock.sendall(b"")  # then the client leaves
    assert done.wait(30.0)  # hang guard
    assert seen == {"task": True, "message": {"type": "http.disconnect"}}


class TakeApp:
    """Takes the body with ``kvguard.body``'s ``take`` when the server holds all of it, else
    reads it with ``receive()``; answers how it got it."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        take = scope["extensions"]["kvguard.body"]["take"]
        body = take()
        again = take()
        how = "take"
        if body is None:
            how, chunks = "receive", []
            while True:
                message = await receive()
                chunks.append(message["body"])
                if not message["more_body"]:
                    break
            body = b"".join(chunks)
        self.seen.append((how, body, again))
        answer = json.dumps({"how": how, "body": body.decode()}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})


def test_take_gives_a_body_already_whole_once_and_receive_one_still_arriving(server):
    srv = server(TakeApp())

    async def main() -> list[dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        answers = []
        # whole in one write; then the same connection, the body split across two writes;
        # then an empty body
        for parts in ([b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"],
                      [b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nhel",
                       b"lo worl"],
                      [b"POST /c HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"]):
            for i, part in enumerate(parts):
                if i:
                    await asyncio.sleep(0.05)
                writer.write(part)
                await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            answers.append(json.loads(await asyncio.wait_for(reader.readexactly(length), 30.0)))
        writer.close()
        return answers

    answers = asyncio.run(main())
    assert answers == [{"how": "take", "body": "hello"}, {"how": "receive", "body": "hello worl"},
                       {"how": "take", "body": ""}]
    assert [again for _, _, again in srv.server.app.seen] == [None, None, None]


class DirectApp(Recorder):
    """A Recorder that also offers ``http_direct``: ``/direct`` is answered by the coroutine it
    returns (what the handler saw: the body, and whether a task was running), ``/direct-now``
    in the handler itself (True), ``/direct-forgot`` says True without answering,
    ``/direct-boom`` raises in the handler, anything else goes to ASGI."""

    def __init__(self) -> None:
        super().__init__()
        self.direct_calls: list[tuple[str, bool]] = []
        self.exchanges: list = []

    def http_direct(self, request, exchange):
        # from the read callback: no task exists for the request yet
        self.direct_calls.append((request.path, asyncio.current_task() is None))
        self.exchanges.append(exchange)
        if request.path == "/direct-boom":
            raise RuntimeError("boom in the direct handler")
        if request.path == "/direct-now":
            exchange.respond(201, [(b"content-length", b"2")], b"ok")
            return True
        if request.path == "/direct-forgot":
            return True
        if request.path != "/direct":
            return None
        body = exchange.take_body()
        return self._answer(exchange, body)

    async def _answer(self, exchange, body: bytes) -> None:
        payload = json.dumps({"body": body.decode(), "in_task": asyncio.current_task() is not None})
        await exchange.send({"type": "http.response.start", "status": 200,
                             "headers": [(b"content-length", str(len(payload)).encode())]})
        await exchange.send({"type": "http.response.body", "body": payload.encode()})


def _post(path: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (path.encode(), len(body)) + body)


async def _in_two_writes(port: int, raw: bytes, split: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw[:split])
        await writer.drain()
        await asyncio.sleep(0.05)  # the head alone first (nothing is timed on it)
        writer.write(raw[split:])
        return await asyncio.wait_for(reader.read(), 30.0)
    finally:
        writer.close()


def _json_body(answer: bytes) -> dict:
    return json.loads(answer.rsplit(b"\r\n\r\n", 1)[1])  # (after any 100 Continue)


def test_an_apps_direct_handler_answers_without_asgi_or_leaves_the_request_to_it(server):
    app = DirectApp()
    srv = server(app)
    direct = _send(srv.port, _post("/direct", b"hello"))
    assert direct.startswith(b"HTTP/1.1 200 ")
    assert _json_body(direct) == {"body": "hello", "in_task": True}  # the rest ran in a task
    asgi = _send(srv.port, _post("/echo", b"via asgi"))
    assert _json_body(asgi)["body"] == "via asgi"  # None: served through ASGI, body intact
    boom = _send(srv.port, _post("/direct-boom", b"x"))
    assert boom.startswith(b"HTTP/1.1 500 ") and b"internal_error" in boom
    now = _send(srv.port, _post("/direct-now", b"x"))
    assert now.startswith(b"HTTP/1.1 201 ") and now.endswith(b"\r\n\r\nok")
    assert app.exchanges[-1].task is None  # answered in the read callback: no task at all
    forgot = _send(srv.port, _post("/direct-forgot", b"x"))
    assert forgot.startswith(b"HTTP/1.1 500 ")
    with httpx.Client(base_url=srv.url) as client:  # GET, no body: offered too
        assert client.get("/get").status_code == 200
    assert app.direct_calls == [("/direct", True), ("/echo", True), ("/direct-boom", True),
                                ("/direct-now", True), ("/direct-forgot", True), ("/get", True)]
    assert [scope["path"] for scope in app.requests] == ["/echo", "/get"]  # only these: ASGI


def test_a_body_after_its_head_is_waited_for_then_offered_to_the_direct_handler(server):
    app = DirectApp()
    srv = server(app)
    raw = _post("/direct", b"late body")
    answer = asyncio.run(_in_two_writes(srv.port, raw, raw.index(b"\r\n\r\n") + 4))
    assert _json_body(answer) == {"body": "late body", "in_task": True}
    assert app.direct_calls == [("/direct", True)] and app.requests == []
    # a client that expects 100-continue is not kept waiting for it: ASGI, as before
    raw = _post("/direct", b"continued").replace(b"connection: close", b"connection: close\r\n"
                                                 b"expect: 100-continue")
    answer = asyncio.run(_in_two_writes(srv.port, raw, raw.index(b"\r\n\r\n") + 4))
    assert _json_body(answer)["body"] == "continued" and app.requests[-1]["path"] == "/direct"
