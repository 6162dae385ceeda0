"""HTTP/1.1 messages for the ``h1`` upstream client: the request head it writes, the response
head it parses and the chunked body framing it removes. Pure functions and one small decoder,
no I/O (:mod:`guard.proxy.h1_connection` drives them from an asyncio protocol).

Strict where a proxy must be (:class:`MessageError`, which the connection turns into a 502): a
status line that is not ``HTTP/1.x NNN [reason]``; a header line that is not ``token ":" value``
(a name with a space or any other non-token byte, a value with a control character other than
HTAB, a bare CR or LF, an obs-fold continuation line); more than ``MAX_HEADERS`` header lines or
one longer than ``MAX_FIELD_BYTES`` (aiohttp's limits); a ``content-length`` that is not one
plain decimal (repeated values must agree), or that comes with a ``transfer-encoding``; a ``transfer-encoding`` other than
exactly ``chunked`` (``identity``, ``gzip, chunked``, ``xchunked``: kvguard would read such a
body differently from another client, so it reads none); a chunk size that is not plain hex,
or a missing CRLF after a chunk's data.
"""

from __future__ import annotations

import re

from guard.proxy.upstream_contract import HOP_BY_HOP, SERVER_WRITTEN
from guard.relay import REQUEST_ID_HEADER
from serving.chunked import ChunkedDecoder as BaseChunkedDecoder
from serving.chunked import ChunkedError

__all__ = ["MessageError", "ResponseHead", "ChunkedDecoder", "request_head", "proxied_request",
           "NOT_FORWARDED", "parse_head", "NO_BODY", "LENGTH", "CHUNKED", "UNTIL_CLOSE",
           "MAX_HEAD_BYTES", "MAX_HEADERS", "MAX_FIELD_BYTES"]

# body framings of a response
NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE = 0, 1, 2, 3
MAX_HEAD_BYTES = 64 * 1024  # a response head longer is garbage
MAX_HEADERS = 128  # header lines in one response head
MAX_FIELD_BYTES = 8190  # one header line, and the status line
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")
# one header line: a token name, a colon, a value without controls but HTAB (trimmed)
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*"
                    rb"((?:[^\x00-\x08\x0a-\x1f\x7f]*[^\x00-\x20\x7f])?)[ \t]*")
# a client's headers the proxy never forwards: the hop-by-hop ones, and its x-request-id (the
# guard's own goes instead)
NOT_FORWARDED = HOP_BY_HOP | {REQUEST_ID_HEADER}


class MessageError(ValueError):
    """The upstream's bytes are not a valid HTTP/1.1 response."""


def request_head(method: bytes, target: bytes, host: bytes,
                 headers: list[tuple[bytes, bytes]], body_length: int | None) -> bytes:
    """``METHOD target HTTP/1.1`` with ``host``, the end-to-end ``headers`` (hop-by-hop ones and
    any with a CR or LF in them are left out) and ``content-length`` unless ``body_length`` is
    None."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        if name.lower() not in HOP_BY_HOP:
            parts += (name, b": ", value, b"\r\n")
    if body_length is not None:
        parts += (b"content-length: ", b"%d" % body_length, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    if head.count(b"\n") != head.count(b"\r\n"):  # a bare LF would split a header in two
        kept = [(n, v) for n, v in headers if not any(c in n or c in v for c in (b"\r", b"\n"))]
        return request_head(method, target, host, kept, body_length)
    return head


def proxied_request(target: bytes, host: bytes, headers: list[tuple[bytes, bytes]],
                    request_id: str, body: bytes) -> bytes:
    """A client's ``POST`` forwarded whole, head and ``body``, built in one pass: ``headers``
    as kvguard's server parsed them (``serving.h1_head``: names lower-case, no CR or LF in any
    name or value), less the hop-by-hop ones and the client's ``x-request-id``, then
    ``x-request-id: request_id`` and the body's ``content-length``. The same bytes as
    :func:`request_head` of those headers with the ``x-request-id`` appended, plus the body
    (a property test holds the two equal)."""
    parts = [b"POST ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        if name not in NOT_FORWARDED:
            parts += (name, b": ", value, b"\r\n")
    parts += (b"x-request-id: ", request_id.encode(), b"\r\ncontent-length: ",
              b"%d" % len(body), b"\r\n\r\n", body)
    return b"".join(parts)


class ResponseHead:
    """A parsed response head: status, end-to-end headers (names lower-case; hop-by-hop,
    ``date`` and ``server`` removed), the body's framing and whether the connection may carry
    another request afterwards."""

    __slots__ = ("status", "headers", "framing", "length", "keep_alive")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], framing: int,
                 length: int, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.framing = framing
        self.length = length  # LENGTH only
        self.keep_alive = keep_alive


def parse_head(head: bytes) -> ResponseHead:
    """The response head ``head`` (without its final blank line); raises :class:`MessageError`."""
    lines = head.split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        raise MessageError(f"more than {MAX_HEADERS} header lines")
    status_line = lines[0]
    match = _STATUS_LINE.fullmatch(status_line) if len(status_line) <= MAX_FIELD_BYTES else None
    if match is None:
        raise MessageError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    status = int(match[2])
    if not 100 <= status <= 599:
        raise MessageError(f"status {status} out of range")
    keep_alive = match[1] == b"1"  # HTTP/1.1
    headers = []
    lengths: list[bytes] = []
    codings: list[bytes] = []
    for line in lines[1:]:
        field = _FIELD.fullmatch(line) if len(line) <= MAX_FIELD_BYTES else None
        if field is None:
            raise MessageError(f"bad header line: {line[:80]!r}")
        name, value = field.groups()
        name = name.lower()
        if name not in SERVER_WRITTEN:
            headers.append((name, value))
        elif name == b"content-length":  # a list of one value repeated reads as that value
            lengths += (v.strip(b" \t") for v in value.split(b","))
        elif name == b"transfer-encoding":
            codings.append(value)
        elif name == b"connection":
            if b"close" in (t.strip(b" \t").lower() for t in value.split(b",")):
                keep_alive = False
    if status < 200 or status in (204, 304):
        return ResponseHead(status, headers, NO_BODY, 0, keep_alive)
    if codings:
        if lengths:
            raise MessageError("both content-length and transfer-encoding")
        if len(codings) != 1 or codings[0].lower() != b"chunked":
            raise MessageError(f"unsupported transfer-encoding {b', '.join(codings)[:80]!r}")
        return ResponseHead(status, headers, CHUNKED, 0, keep_alive)
    if lengths:
        length = lengths[0]
        if lengths.count(length) != len(lengths):
            raise MessageError(f"conflicting content-length values {sorted(set(lengths))!r}")
        if not length.isdigit() or len(length) > 18:
            raise MessageError(f"bad content-length {length[:40]!r}")
        return ResponseHead(status, headers, LENGTH, int(length), keep_alive)
    return ResponseHead(status, headers, UNTIL_CLOSE, 0, False)


class ChunkedDecoder(BaseChunkedDecoder):
    """Removes chunked framing from bytes fed in any split (:mod:`serving.chunked`, the decoder
    kvguard's server uses too; an upstream's trailers are bounded and dropped unread); ``done``
    once the last chunk and its trailer are in, ``extra`` when bytes followed them (the
    connection is not reusable)."""

    __slots__ = ("extra",)

    def __init__(self) -> None:
        super().__init__(trailer_field=None)
        self.extra = False

    def feed(self, data: bytes) -> list[bytes]:
        """The body bytes in ``data``, in order; raises :class:`MessageError` on bad framing."""
        out: list[bytes] = []
        try:
            used = self.decode(data, out)
        except ChunkedError as exc:
            raise MessageError(str(exc)) from None
        if used < len(data):
            self.extra = True
        return out
