"""The h1 client's HTTP/1.1 messages: request heads, response heads, chunked framing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.proxy.exchange import upstream_headers as _upstream_headers
from guard.proxy.h1_message import (
    CHUNKED,
    LENGTH,
    NO_BODY,
    UNTIL_CLOSE,
    ChunkedDecoder,
    MessageError,
    parse_head,
    proxied_request,
    request_head,
)
from serving.h1_head import parse_head as parse_request_head

# chunks whose data looks like framing (CRLFs, "0"), one with an extension, then a trailer
PIECES = [b"data: ", b'{"text": "a\\r\\n0\\r\\n"}\r\n\n', b"\r\n\r", b"0\r\n\r\n"]
CHUNKED_BODY = (b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";name=value" if i == 1 else b"", p)
                         for i, p in enumerate(PIECES)) + b"0\r\nx-trailer: 1\r\n\r\n")
DECODED = b"".join(PIECES)


def _decode(pieces) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    out = b""
    for piece in pieces:
        assert not decoder.done
        out += b"".join(decoder.feed(piece))
    return out, decoder


def test_chunked_body_split_at_every_byte_boundary():
    out, decoder = _decode([CHUNKED_BODY])
    assert out == DECODED and decoder.done and not decoder.extra
    for split in range(1, len(CHUNKED_BODY)):
        out, decoder = _decode([CHUNKED_BODY[:split], CHUNKED_BODY[split:]])
        assert out == DECODED and decoder.done and not decoder.extra, split
    for second in range(2, len(CHUNKED_BODY)):  # and in three pieces
        out, decoder = _decode([CHUNKED_BODY[:1], CHUNKED_BODY[1:second], CHUNKED_BODY[second:]])
        assert out == DECODED and decoder.done, second
    out, decoder = _decode([CHUNKED_BODY[i:i + 1] for i in range(len(CHUNKED_BODY))])
    assert out == DECODED and decoder.done


def test_chunked_pieces_come_out_as_they_are_fed():
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nhel") == [b"hel"]  # part of a chunk is handed on at once
    assert decoder.feed(b"lo\r\n") == [b"lo"]
    assert decoder.feed(b"0\r\n\r\n") == [] and decoder.done and not decoder.extra


def test_bytes_after_the_last_chunk_are_flagged():
    decoder = ChunkedDecoder()
    assert decoder.feed(b"1\r\na\r\n0\r\n\r\nHTTP/1.1 200 OK") == [b"a"]
    assert decoder.done and decoder.extra


@pytest.mark.parametrize("bad", [b"0x5\r\nhello\r\n", b"+5\r\nhello\r\n", b"5_0\r\n",
                                 b"\r\n", b"zz\r\n", b"5\nhello\r\n", b"5\r\nhelloXY",
                                 b"5\r\nhello\rX", b"1" * 17 + b"\r\n"])
def test_bad_chunk_framing_raises(bad):
    with pytest.raises(MessageError):
        ChunkedDecoder().feed(bad)


def test_an_endless_chunk_size_line_raises():
    decoder = ChunkedDecoder()
    with pytest.raises(MessageError):
        for _ in range(100):
            decoder.feed(b"0" * 1024)


def test_response_head_keeps_end_to_end_headers_and_reads_the_framing():
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\nKeep-Alive: x\r\n"
                      b"Date: now\r\nServer: uvicorn\r\nX-Request-Id: r1\r\nX-Empty:\r\n"
                      b"X-Spaced:  a b \t")
    assert head.status == 200 and head.framing == CHUNKED and head.keep_alive
    assert head.headers == [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r1"),
                            (b"x-empty", b""), (b"x-spaced", b"a b")]


@pytest.mark.parametrize("raw, status, framing, length, keep_alive", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12", 200, LENGTH, 12, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12, 12", 200, LENGTH, 12, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 0", 200, LENGTH, 0, True),
    (b"HTTP/1.1 200", 200, UNTIL_CLOSE, 0, False),  # no framing: the body ends at close
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2", 200, LENGTH, 2, False),
    (b"HTTP/1.1 200 OK\r\nConnection: Upgrade, Close\r\ncontent-length: 2", 200, LENGTH, 2,
     False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 2", 200, LENGTH, 2, False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked", 200, CHUNKED, 0, True),
    (b"HTTP/1.1 204 No Content\r\ncontent-length: 7", 204, NO_BODY, 0, True),
    (b"HTTP/1.1 304 Not Modified", 304, NO_BODY, 0, True),
    (b"HTTP/1.1 100 Continue", 100, NO_BODY, 0, True),
    (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 7\r\ncontent-length: 2", 503, LENGTH,
     2, True),
])
def test_response_head_framing(raw, status, framing, length, keep_alive):
    head = parse_head(raw)
    assert (head.status, head.framing, head.length, head.keep_alive) == \
        (status, framing, length, keep_alive)


@pytest.mark.parametrize("raw", [
    b"\x00\x01 this is not HTTP at all ", b"HTTP/2 200 OK", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK",
    b"HTTP/1.1 abc OK", b"HTTP/1.1 099 Low", b"HTTP/1.1 600 High", b"HTTP/1.2 200 OK",
    b"HTTP/1.1  200 OK", b"http/1.1 200 OK", b"HTTP/1.1 200 OK\r\nno colon here",
    b"HTTP/1.1 200 OK\r\nbad name: x", b"HTTP/1.1 200 OK\r\n: empty name",
    b"HTTP/1.1 200 OK\r\n folded: x", b"HTTP/1.1 200 OK\r\nbad\tname: x",
    b"HTTP/1.1 200 OK\r\nbad\nname: x", b"HTTP/1.1 200 OK\r\nbad\rname: x",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2",
    b"HTTP/1.1 200 OK\r\ncontent-length: -1", b"HTTP/1.1 200 OK\r\ncontent-length: 0x10",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1" + b"0" * 20,
])
def test_garbage_response_heads_raise(raw):
    with pytest.raises(MessageError):
        parse_head(raw)


def test_request_head_frames_the_body_and_drops_hop_by_hop_headers():
    head = request_head(b"POST", b"/v1/completions?x=1", b"127.0.0.1:8001",
                        [(b"content-type", b"application/json"), (b"Connection", b"close"),
                         (b"transfer-encoding", b"chunked"), (b"host", b"evil"),
                         (b"content-length", b"999"), (b"x-request-id", b"g-1")], 17)
    assert head == (b"POST /v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8001\r\n"
                    b"content-type: application/json\r\nx-request-id: g-1\r\n"
                    b"content-length: 17\r\n\r\n")
    assert request_head(b"GET", b"/health", b"h", [], None) == \
        b"GET /health HTTP/1.1\r\nhost: h\r\n\r\n"


def test_request_head_leaves_out_headers_that_would_split_the_head():
    head = request_head(b"POST", b"/", b"h", [(b"x-a", b"1\r\nx-injected: 1"), (b"x-b", b"2\n"),
                                              (b"x-c", b"3")], 0)
    assert head == b"POST / HTTP/1.1\r\nhost: h\r\nx-c: 3\r\ncontent-length: 0\r\n\r\n"


# any names but the framing ones (host, content-length: one each, written below)
_NAMES = (st.sampled_from(["Connection", "Keep-Alive", "TE", "Upgrade", "Proxy-Authorization",
                           "Proxy-Connection", "Trailer", "X-Request-Id", "Authorization",
                           "User-Agent", "Content-Type", "Accept", "X-Kvguard-Class",
                           "Idempotency-Key"])
          | st.from_regex(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}", fullmatch=True)).filter(
    lambda name: name.lower() not in ("host", "content-length", "transfer-encoding"))
_VALUES = st.from_regex(r"[\x20-\x7e\x80-\xff]{0,20}", fullmatch=True).map(
    lambda v: v.strip(" \t"))


@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=8), st.binary(max_size=40),
       st.sampled_from(["g-1a2b-7", "caller's-id-42"]))
def test_a_proxied_request_is_the_request_head_of_the_forwarded_headers(fields, body,
                                                                        request_id):
    """``proxied_request`` (the proxy's one-pass upstream request, from its read callback) is
    byte for byte what the general path writes: ``request_head`` of the client's headers less
    hop-by-hop and ``x-request-id``, with the guard's ``x-request-id``, then the body; for any
    headers kvguard's server accepts (parsed by it here, so names lower-case, values clean)."""
    lines = [f"{name}: {value}" for name, value in fields]
    lines.insert(len(lines) // 2, f"Content-Length: {len(body)}")
    lines.insert(len(lines) // 3, "Host: proxy.local:9000")
    head = "\r\n".join(["POST /v1/completions HTTP/1.1", *lines]).encode("latin-1")
    headers = parse_request_head(head).headers  # what the proxy's direct handler is given
    assert len(headers) == len(fields) + 2
    expected = request_head(b"POST", b"/v1/completions", b"10.0.0.7:8001",
                            _upstream_headers(headers, request_id), len(body)) + body
    assert proxied_request(b"/v1/completions", b"10.0.0.7:8001", headers, request_id,
                           body) == expected
