"""Differential request parsing: the same hostile bytes sent to kvguard's HTTP/1.1 server and,
beside it, to uvicorn on h11 and on httptools, each in front of one recording ASGI app.

Each vector is one connection's bytes (one or more requests, valid or not) followed by a
closing ``GET /sentinel``. What counts is what each server's app was handed: the sequence of
requests (method, path, query, the header fields, the body). kvguard must never read a
request that a library that also reads it reads differently (the request-smuggling property:
two parsers in a chain agree on every request, or one of them refuses), must answer every
vector it refuses with a 4xx/5xx that closes the connection (never a 500), and must never send
one request's response to another. Every server here is real, on loopback; the vectors are
generated from a small grammar of the ways framing goes wrong."""

from __future__ import annotations

import itertools
import socket

import pytest

from serving import ServerLimits
from serving.limited_protocol import ConnectionTable
from tests.support.loopback import H1LoopbackServer, LoopbackServer

SENTINEL = b"GET /sentinel HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
WAIT_S = 1.0  # a server still waiting for bytes after this long has not read the vector


class RecordingApp:
    """Records every request it is handed (body read whole) and answers ``seen:<n>``."""

    def __init__(self) -> None:
        self.requests: list[tuple] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        fields = tuple((bytes(n).lower(), bytes(v).strip(b" \t")) for n, v in scope["headers"]
                       if bytes(n).lower() not in (b"connection",))
        self.requests.append((scope["method"], scope["raw_path"], scope["query_string"], fields,
                              body))
        answer = b"seen:%d" % (len(self.requests) - 1)
        # a 2xx to CONNECT would switch h11 to a tunnel: refuse it instead
        await send({"type": "http.response.start",
                    "status": 405 if scope["method"] == "CONNECT" else 200,
                    "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


def _post(framing: bytes, body: bytes, path: bytes = b"/p") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n" + framing + b"\r\n" + body


def vectors() -> list[bytes]:
    """Connection payloads, each to be followed by the sentinel."""
    out = [
        b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET /a?b=c HTTP/1.0\r\n\r\n",
        _post(b"content-length: 5\r\n", b"hello"),
        _post(b"transfer-encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
        _post(b"content-length: 5\r\n", b"hello") + _post(b"content-length: 3\r\n", b"abc"),
        b"\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n",  # empty lines before a request line
        _post(b"expect: 100-continue\r\ncontent-length: 2\r\n", b"hi"),
    ]
    # content-length spellings and pairs
    for length in (b"5", b"05", b"+5", b"-5", b"5 ", b" 5", b"5,5", b"5, 5", b"5,6", b"0x5",
                   b"5.0", b"5\x00", b"\x0b5", b"99999999999999999999", b"", b"five"):
        out.append(_post(b"content-length: " + length + b"\r\n", b"hello"))
    for first, second in ((b"5", b"5"), (b"5", b"6"), (b"6", b"5"), (b"5", b"")):
        out.append(_post(b"content-length: %s\r\ncontent-length: %s\r\n" % (first, second),
                         b"hello!"))
    # transfer-encoding spellings, pairs and with content-length (the smuggling pair)
    chunked_body = b"5\r\nhello\r\n0\r\n\r\n"
    for coding in (b"chunked", b"Chunked", b"CHUNKED", b" chunked", b"chunked ", b"\tchunked",
                   b"chunked, identity", b"identity, chunked", b"gzip, chunked", b"xchunked",
                   b"chunked\x0b", b"chunk", b"identity", b'"chunked"', b"chunked;q=1",
                   b"chunked,", b",chunked"):
        out.append(_post(b"transfer-encoding: " + coding + b"\r\n", chunked_body))
    for order in ((b"transfer-encoding: chunked\r\n", b"content-length: 5\r\n"),
                  (b"content-length: 5\r\n", b"transfer-encoding: chunked\r\n"),
                  (b"content-length: 30\r\n", b"transfer-encoding: chunked\r\n"),
                  (b"transfer-encoding: chunked\r\n", b"transfer-encoding: chunked\r\n"),
                  (b"transfer-encoding: chunked\r\n", b"transfer-encoding: identity\r\n"),
                  (b"transfer-encoding: identity\r\n", b"transfer-encoding: chunked\r\n")):
        out.append(_post(b"".join(order), chunked_body))
    out.append(b"POST /p HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n" + chunked_body)
    # chunk framing
    for size_line in (b"5", b"05", b"+5", b"-5", b"0x5", b"5 ", b" 5", b"5;ext", b"5;e=\"x\"",
                      b"5;e=\"x;y\"", b"5\t", b"5 ;ext", b"ffffffffffffffff5", b"5\x00", b"g",
                      b"", b"5\n"):
        out.append(_post(b"transfer-encoding: chunked\r\n",
                         size_line + b"\r\nhello\r\n0\r\n\r\n"))
    for tail in (b"5\r\nhelloX\r\n0\r\n\r\n", b"5\r\nhello0\r\n\r\n", b"5\r\nhello\n0\r\n\r\n",
                 b"5\r\nhello\r\n0\r\nx-trailer: t\r\n\r\n", b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n",
                 b"5\r\nhello\r\n0\r\n x-fold: t\r\n\r\n", b"5\r\nhello\r\n0\n\n",
                 b"5\r\nhello\r\n0\r\n\r\nGARBAGE", b"3\r\nhello\r\n0\r\n\r\n"):
        out.append(_post(b"transfer-encoding: chunked\r\n", tail))
    # line endings
    base = [b"POST /p HTTP/1.1", b"host: x", b"content-length: 5", b"", b""]
    for i, ending in itertools.product(range(4), (b"\n", b"\r", b"\r\r\n", b"\n\r")):
        lines = [line + (ending if j == i else b"\r\n") for j, line in enumerate(base[:4])]
        out.append(b"".join(lines) + b"hello")
    out.append(b"GET / HTTP/1.1\nhost: x\n\n")
    # request lines
    for line in (b"GET  / HTTP/1.1", b"GET / HTTP/1.1 ", b"GET\t/ HTTP/1.1", b"get / HTTP/1.1",
                 b"GET / HTTP/1.2", b"GET / HTTP/2.0", b"GET / http/1.1", b"GET /", b"GET / x",
                 b"GET /a b HTTP/1.1", b"GET /\x00 HTTP/1.1", b"GET /\x7f HTTP/1.1",
                 b"GET /\xff HTTP/1.1", b"GET http://x/a?b HTTP/1.1", b"GET * HTTP/1.1",
                 b"OPTIONS * HTTP/1.1", b"GET /#frag HTTP/1.1", b"GET a HTTP/1.1",
                 b"G(T / HTTP/1.1", b" GET / HTTP/1.1", b"CONNECT x:1 HTTP/1.1",
                 b"GET /%2F%3F%23 HTTP/1.1", b"GET /a?b#c HTTP/1.1"):
        out.append(line + b"\r\nhost: x\r\n\r\n")
    # header lines
    for field in (b"x-a : b", b"x-a\t: b", b" x-a: b", b"x-a: b\r\n c", b"x-a: b\r\n\tc",
                  b": b", b"x-a", b"x a: b", b"x-a: b\x00c", b"x-a: b\x01c", b"x-a: b\x7fc",
                  b"x-a: b\x80c", b"x-a:b", b"x-a:   ", b"x\x00a: b", b"x-\xe4: b",
                  b"x-a: " + b"b" * 20000, b"host: y", b"content-length: 0"):
        out.append(b"GET / HTTP/1.1\r\nhost: x\r\n" + field + b"\r\n\r\n")
    out.append(b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: a\r\n" % i for i in range(120)) +
               b"host: x\r\n\r\n")
    out.append(b"GET / HTTP/1.1\r\n\r\n")  # no host on 1.1
    return out


def exchange(url: str, payload: bytes) -> tuple[bytes, bool]:
    """Send ``payload`` and the sentinel on one connection; (every byte answered, whether the
    server closed before WAIT_S of silence)."""
    host, port = url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.settimeout(WAIT_S)
        try:
            sock.sendall(payload + SENTINEL)
        except OSError:
            pass  # the server refused and closed while the payload went out
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, False
        except OSError:
            pass  # reset after the answer
    return received, True


@pytest.fixture(scope="module")
def servers():
    apps = {name: RecordingApp() for name in ("kvguard", "h11", "httptools")}
    limits = ServerLimits(header_timeout_s=30.0, body_timeout_s=30.0)
    running = {"kvguard": H1LoopbackServer(apps["kvguard"], ConnectionTable(limits)),
               "h11": LoopbackServer(apps["h11"], http="h11"),
               "httptools": LoopbackServer(apps["httptools"], http="httptools")}
    for server in running.values():
        server.__enter__()
    try:
        yield {name: (apps[name], running[name].url) for name in apps}
    finally:
        for server in running.values():
            server.__exit__(None, None, None)


def _read_by(servers, payload: bytes) -> dict[str, tuple[list[tuple], bytes, bool]]:
    out = {}
    for name, (app, url) in servers.items():
        del app.requests[:]
        answer, closed = exchange(url, payload)
        requests = [r for r in app.requests if r[1] != b"/sentinel"]
        out[name] = (requests, answer, closed)
    return out


def _statuses(answer: bytes) -> list[int]:
    return [int(answer[i + 9:i + 12]) for i in range(len(answer))
            if answer.startswith(b"HTTP/1.1 ", i) and answer[i + 9:i + 12].isdigit()]


def _differs(mine: tuple, other: tuple, payload: bytes) -> bool:
    """Whether two servers read one request differently. Spellings that mean the same are
    equal: an absolute-form target and its path (uvicorn's h11 passes the whole URL on), a
    transfer coding's case; and a trailer field uvicorn's httptools adds to the headers is no
    field of the head."""
    method, path, query, fields, body = other
    if path.startswith((b"http://", b"https://")):
        path = b"/" + path.split(b"/", 3)[3] if path.count(b"/") >= 3 else b"/"
    if (mine[0], mine[1], mine[2], mine[4]) != (method, path, query, body):
        return True
    ours = {n: v.lower() if n == b"transfer-encoding" else v for n, v in mine[3]}
    theirs = {n: v.lower() if n == b"transfer-encoding" else v for n, v in fields}
    head = payload.split(b"\r\n\r\n", 1)[0].lower()
    extra = set(theirs) - set(ours)
    return any(theirs[n] != v for n, v in ours.items() if n in theirs) or \
        any(n in head for n in extra) or any(n not in theirs for n in ours)


def test_kvguard_reads_no_request_differently_from_h11_or_httptools(servers):
    mismatches = []
    for payload in vectors():
        seen = _read_by(servers, payload)
        ours, answer, closed = seen["kvguard"]
        for name in ("h11", "httptools"):
            theirs = seen[name][0]
            for mine, other in zip(ours, theirs, strict=False):  # the common prefix
                if _differs(mine, other, payload):
                    mismatches.append((payload[:120], name, mine, other))
        # kvguard closed every connection it was sent (the sentinel asks it to), or refused
        # it: never left waiting on a request it half-read
        assert closed, (payload[:120], answer[:200])
        assert 500 not in _statuses(answer), (payload[:120], answer[:300])
        # every answer to a request it read is that request's, in order
        seen_marks = [int(mark) for mark in answer.split(b"seen:")[1:] if mark[:1].isdigit()
                      for mark in [mark.split(b"HTTP/")[0]]]
        assert seen_marks == sorted(seen_marks), (payload[:120], answer[:300])
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("payload", [
    b"GET / HTTP/1.1\nhost: x\n\n",
    b"POST /p HTTP/1.1\r\nhost: x\ncontent-length: 5\r\n\r\nhello",
    b"GET / HTTP/1.1\r\nhost: x\r\n\n",
])
def test_a_bare_lf_request_is_a_400_and_a_close_at_once(servers, payload):
    app, url = servers["kvguard"]
    host, port = url.removeprefix("http://").split(":")
    del app.requests[:]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(payload)  # no sentinel: the answer must not wait for more bytes
        answer = b""
        while chunk := sock.recv(65536):  # the server closes (hang guard: the timeout)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"connection: close" in answer.lower()
    assert app.requests == []


@pytest.mark.parametrize("payload", [
    _post(b"transfer-encoding: chunked\r\ncontent-length: 5\r\n", b"0\r\n\r\n"),
    _post(b"content-length: 5\r\ncontent-length: 6\r\n", b"hello!"),
    _post(b"transfer-encoding: chunked, identity\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
    _post(b"transfer-encoding: xchunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
    _post(b"transfer-encoding: chunked\r\n", b"5;e=\"x\r\nhello\r\n0\r\n\r\n"),
    _post(b"content-length: +5\r\n", b"hello"),
    b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\r\n c\r\n\r\n",
])
def test_the_smuggling_framings_are_refused(servers, payload):
    requests, answer, _ = _read_by({"kvguard": servers["kvguard"]}, payload)["kvguard"]
    assert requests == [], payload
    assert _statuses(answer)[:1] == [400], answer[:200]
