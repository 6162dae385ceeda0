"""Differential response parsing: the same hostile upstream responses read by the proxy's h1
client, by aiohttp (the fallback client) over the same loopback connection kind, and by h11
(sans-IO: the same bytes fed to its client state machine).

For every response vector the h1 client must either refuse it (an :class:`UpstreamError`, and
for a malformed head at once, not after the read timeout) or read the status and body that
each library that also reads it reads; every header it hands on must be a valid field; and the
next request sent through it must get its own response, never bytes left over from the vector
(a response split or smuggled into the pool). A scripted upstream on loopback answers
``/v/<i>`` with vector ``i`` and ``/next/<i>`` with a body naming it."""

from __future__ import annotations

import asyncio
import re

import h11
from scripted_upstream import ScriptedUpstream

from guard.proxy.h1_message import MAX_HEADERS
from guard.proxy.h1_transport import H1Transport
from guard.proxy.transports import AiohttpTransport, UpstreamError, UpstreamTimeout

READ_TIMEOUT_S = 0.5  # vectors that leave a body unfinished wait this long (few do)
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")


def _head(status_line: bytes, *fields: bytes) -> bytes:
    return status_line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


def _ok(*fields: bytes) -> bytes:
    return _head(b"HTTP/1.1 200 OK", b"content-type: application/json", *fields)


CHUNKED = b"transfer-encoding: chunked"
# (response bytes, close after writing them, may wait out the read timeout)
VECTORS: list[tuple[bytes, bool, bool]] = [
    (_ok(b"content-length: 5") + b"hello", False, False),
    (_ok(CHUNKED) + b"5\r\nhello\r\n0\r\n\r\n", False, False),
    (_ok() + b"hello", True, False),  # until close
    (_head(b"HTTP/1.0 200 OK", b"content-length: 5") + b"hello", False, False),
    (_head(b"HTTP/1.1 204 No Content", b"content-length: 5"), False, False),
    (_head(b"HTTP/1.1 100 Continue") + _ok(b"content-length: 2") + b"ok", False, False),
    (_head(b"HTTP/1.1 103 Early Hints", b"link: </a>") + _ok(b"content-length: 2") + b"ok",
     False, False),
    (_ok(CHUNKED) + b"5;a=b;c=\"d e\"\r\nhello\r\n0\r\nx-t: 1\r\n\r\n", False, False),
    (_ok(b"content-length: 2") + b"okHTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nSMUGGLED",
     False, False),  # a second response after the first: never the next request's
    (_ok(CHUNKED) + b"2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nSMUGGLED",
     False, False),
    (_head(b"HTTP/1.1 101 Switching Protocols", b"upgrade: websocket",
           b"connection: upgrade"), False, False),
]
for _length in (b"5, 5", b"5,6", b"+5", b"05", b"-5", b"5 5", b"0x5", b"", b"5\x00",
                b"99999999999999999999"):
    VECTORS.append((_ok(b"content-length: " + _length) + b"hello", False, True))
VECTORS += [
    (_ok(b"content-length: 5", b"content-length: 5") + b"hello", False, False),
    (_ok(b"content-length: 5", b"content-length: 6") + b"hello!", False, False),
    (_ok(b"content-length: 5", CHUNKED) + b"5\r\nhello\r\n0\r\n\r\n", False, False),
    (_ok(CHUNKED, b"content-length: 5") + b"hello", False, False),
    (_ok(CHUNKED, CHUNKED) + b"5\r\nhello\r\n0\r\n\r\n", False, False),
]
for _coding in (b"Chunked", b"identity", b"xchunked", b"gzip, chunked", b"chunked, gzip",
                b"chunked, identity", b"identity, chunked", b" chunked", b"chunked;q=1"):
    VECTORS.append((_ok(b"transfer-encoding: " + _coding) + b"5\r\nhello\r\n0\r\n\r\n", False,
                    False))
for _chunks in (b"0x5\r\nhello\r\n0\r\n\r\n", b"+5\r\nhello\r\n0\r\n\r\n",
                b"5\nhello\n0\n\n", b"5\r\nhelloXX0\r\n\r\n", b"5;e=\"x\r\nhello\r\n0\r\n\r\n",
                b"5 \r\nhello\r\n0\r\n\r\n", b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n",
                b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n", b"-5\r\nhello\r\n0\r\n\r\n"):
    VECTORS.append((_ok(CHUNKED) + _chunks, False, False))
for _field in (b"x-evil: a\nx-smuggled: b", b"x-evil: a\rb", b"x-evil: a\x00b", b"x-evil: a\x01b",
               b"x-evil: a\x7fb", b"x evil: a", b"x-evil : a", b" x-evil: a", b": a",
               b"x-evil", b"x-evil: a\r\n b", b"x-\xe4vil: a", b"x-evil: " + b"a" * 10_000,
               b"x-evil: a\tb", b"x-evil: a\x80b"):
    VECTORS.append((_ok(_field, b"content-length: 2") + b"ok", False, False))
VECTORS += [
    (_ok(*(b"x-evil-%d: a" % i for i in range(MAX_HEADERS + 10)), b"content-length: 2") + b"ok",
     False, False),
    (_ok(*(b"x-evil-%d: a" % i for i in range(10_000)), b"content-length: 2") + b"ok",
     False, False),
    (b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok", False, False),  # bare-LF head, kept open
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\n\r\nok", False, False),
]
for _status in (b"HTTP/1.1 200", b"HTTP/1.1 200 ", b"HTTP/1.1 2000 OK", b"HTTP/1.2 200 OK",
                b"HTTP/2 200 OK", b"http/1.1 200 OK", b"HTTP/1.1  200 OK", b"HTTP/1.1 20 OK",
                b"HTTP/1.1 600 OK", b"HTTP/1.1 200 O\x00K", b"ICY 200 OK", b"HTTP/1.1 099 OK"):
    VECTORS.append((_head(_status, b"content-length: 2") + b"ok", False, False))


def answer(target: bytes):
    kind, _, index = target.decode().rpartition("/")
    if kind == "/next":
        body = b"next-" + index.encode()
        return _ok(b"content-length: %d" % len(body)) + body
    data, close, _ = VECTORS[int(index)]
    return (data, True) if close else data


async def _read(client, url: str) -> tuple:
    try:
        response = await client.send(url, [(b"content-type", b"application/json")], b"{}")
        try:
            body = b"".join([chunk async for chunk in response.chunks()])
        finally:
            await response.aclose()
    except UpstreamError as exc:
        return ("error", type(exc).__name__)
    return ("ok", response.status, response.headers, body)


def _h11_reads(data: bytes, close: bool) -> tuple:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v", headers=[("host", "x"),
                                                                 ("content-length", "2")]))
    conn.send(h11.Data(data=b"{}"))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if close:
        conn.receive_data(b"")
    status, body = None, b""
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return ("ok", status, body)
            elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return ("incomplete",)
            elif event is h11.PAUSED:
                return ("incomplete",)
    except h11.RemoteProtocolError:
        return ("error",)


def test_the_h1_client_reads_no_response_differently_and_never_crosses_responses():
    async def main(url: str) -> list:
        h1 = H1Transport(2.0, READ_TIMEOUT_S, 4)
        aio = AiohttpTransport(2.0, READ_TIMEOUT_S, 4, 1)
        problems = []
        for i, (data, close, may_wait) in enumerate(VECTORS):
            ours = await _read(h1, f"{url}/v/{i}")
            theirs = {"aiohttp": await _read(aio, f"{url}/v/{i}"), "h11": _h11_reads(data, close)}
            if ours[0] == "ok":
                status, headers, body = ours[1:]
                for name, other in theirs.items():
                    if other[0] == "ok" and (other[1], other[-1]) != (status, body):
                        problems.append((i, name, "read differently", ours, other))
                if len(headers) > MAX_HEADERS or not all(
                        _TOKEN.fullmatch(n) and _VALUE.fullmatch(v) for n, v in headers):
                    problems.append((i, "h1", "relayed a malformed header", headers[:3]))
            elif ours[1] == UpstreamTimeout.__name__ and not may_wait:
                problems.append((i, "h1", "waited out the read timeout", data[:80]))
            following = await _read(h1, f"{url}/next/{i}")
            if following[0] != "ok" or following[3] != b"next-%d" % i:
                problems.append((i, "h1", "the next request got another answer", following))
        await h1.aclose()
        await aio.aclose()
        return problems

    with ScriptedUpstream(answer) as upstream:
        problems = asyncio.run(main(upstream.url))
    assert not problems, problems[:5]
