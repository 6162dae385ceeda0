"""Strict parsing of an HTTP/1.1 request head and of a chunked request body (``serving.h1server``).

``parse_head(head)`` takes the bytes before the blank line and returns a ``RequestHead`` or
raises ``BadRequest(status, reason)``; nothing that fails here ever reaches the app. Refused
(400 unless said):

* a malformed request line (not ``METHOD SP target SP HTTP/x.y``, a method that is not a token,
  a target with a control character, space or non-ASCII byte, or not in origin form / ``*``
  / absolute form); ``CONNECT``; a version other than 1.0 / 1.1 (505);
* a malformed header line: no colon, whitespace before the colon, a name that is not a token,
  a control character in the value, a bare CR or LF, a continuation line (obs-fold);
* more than ``MAX_HEADERS`` header lines (431); an HTTP/1.1 request without exactly one Host;
* ``Content-Length`` not all digits (so never negative), longer than 18 digits, or repeated
  with a different value; ``Transfer-Encoding`` other than exactly ``chunked`` (or on HTTP/1.0);
  both ``Content-Length`` and ``Transfer-Encoding`` (the request-smuggling pair).

The head's size limit (``MAX_HEAD_BYTES``, 431) is the connection's to check while bytes
arrive. ``ChunkedBody`` decodes a chunked body incrementally with the same strictness (the one
decoder both HTTP halves share, :mod:`serving.chunked`; here trailers must be header fields).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from serving.chunked import ChunkedDecoder, ChunkedError

__all__ = ["BadRequest", "ChunkedBody", "MAX_HEADERS", "MAX_HEAD_BYTES", "RequestHead",
           "parse_head"]

MAX_HEAD_BYTES = 16 * 1024  # request line and headers (h11's default)
MAX_HEADERS = 100

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_HEADER = re.compile(rb"(" + _TOKEN + rb"):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*?)[ \t]*")
# _HEADER, every line of a block (each ends in CR); its value greedy up to its last character
# that is not blank (the same match as _HEADER's lazy one, without trying each end in turn)
_HEADER_LINES = re.compile(rb"^(" + _TOKEN + rb"):[ \t]*((?:[^\x00-\x08\x0a-\x1f\x7f]*"
                           rb"[^\x00-\x20\x7f])?)[ \t]*\r$", re.MULTILINE)
_ABSOLUTE = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)


class BadRequest(Exception):
    """A request the server answers itself (``status``) and then closes the connection."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class RequestHead:
    """What the server needs from one parsed head (headers lower-cased, values stripped)."""

    __slots__ = ("method", "raw_path", "path", "query_string", "http_version", "headers",
                 "content_length", "chunked", "keep_alive", "expect_continue")

    def __init__(self, method: str, raw_path: bytes, query_string: bytes, http_version: str,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self.method = method
        self.raw_path = raw_path
        text = raw_path.decode("ascii")
        self.path = unquote(text) if "%" in text else text
        self.query_string = query_string
        self.http_version = http_version
        self.headers = headers
        self.content_length: int | None = None
        self.chunked = False
        self.keep_alive = http_version == "1.1"
        self.expect_continue = False


def parse_head(head: bytes) -> RequestHead:
    """The request head (request line and header lines, without the final blank line).

    One function for the usual request (an origin-form target, valid lines): the header
    names lower-cased and the framing read in the same loop. The rarer cases go to helpers."""
    if head.count(b"\r\n") > MAX_HEADERS:
        raise BadRequest(431, "too many header lines")
    end = head.find(b"\r\n")
    match = _REQUEST_LINE.fullmatch(head if end < 0 else head[:end])
    if match is None:
        raise BadRequest(400, "malformed request line")
    method_b, target, major, minor = match.groups()
    if (major, minor) not in ((b"1", b"1"), (b"1", b"0")):
        raise BadRequest(505, "HTTP version not supported")
    method = method_b.decode("ascii")
    if method == "CONNECT":
        raise BadRequest(400, "CONNECT is not supported")
    if target[0] == 0x2F and target.find(b"#") < 0:  # "/...", no fragment: the usual target
        raw_path, _, query_string = target.partition(b"?")
    else:
        raw_path, query_string = _split_target(target, method)
    http11 = minor == b"1"
    headers: list[tuple[bytes, bytes]] = []
    content_length: int | None = None
    transfer_encoding = None
    num_hosts = 0
    keep_alive = http11
    expect_continue = False
    if end >= 0:
        block = head[end + 2:]
        # one scan for the whole block: a line matches only whole (anchored at its start,
        # ending at its CR), so as many matches as lines means every line is a valid field line
        found = _HEADER_LINES.findall(block + b"\r")
        if len(found) != block.count(b"\n") + 1:
            _refuse_header_block(block)
        for name, value in found:  # names lower-cased; body framing, keep-alive, Expect
            name = name.lower()
            headers.append((name, value))
            if name == b"content-length":
                if not value.isdigit() or len(value) > 18:
                    raise BadRequest(400, "invalid content-length")
                length = int(value)
                if content_length is not None and content_length != length:
                    raise BadRequest(400, "conflicting content-length headers")
                content_length = length
            elif name == b"transfer-encoding":
                if transfer_encoding is not None or value.lower() != b"chunked":
                    raise BadRequest(400, "transfer-encoding other than chunked")
                transfer_encoding = value
            elif name == b"host":
                num_hosts += 1
            elif name == b"connection":
                value = value.lower()
                if value == b"keep-alive" or value == b"close":  # one token, the usual value
                    tokens = (value,)
                else:
                    tokens = {t.strip() for t in value.split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens and not http11:
                    keep_alive = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
    if http11 and num_hosts != 1:
        raise BadRequest(400, "an HTTP/1.1 request needs exactly one host header")
    request = RequestHead(method, raw_path, query_string, "1.1" if http11 else "1.0", headers)
    request.content_length = content_length
    request.keep_alive = keep_alive
    request.expect_continue = expect_continue
    if transfer_encoding is not None:  # the request-smuggling pair, and chunked on 1.0
        if content_length is not None:
            raise BadRequest(400, "both content-length and transfer-encoding")
        if not http11:
            raise BadRequest(400, "transfer-encoding on HTTP/1.0")
        request.chunked = True
    return request


def _split_target(target: bytes, method: str) -> tuple[bytes, bytes]:
    if target[0] != 0x2F:  # "/"
        if target == b"*" and method == "OPTIONS":
            return b"*", b""
        absolute = _ABSOLUTE.match(target)
        if absolute is None:
            raise BadRequest(400, "request target is not a path")
        target = target[absolute.end():] or b"/"
        if target[0] != 0x2F:
            raise BadRequest(400, "request target is not a path")
    if target.find(b"#") >= 0:  # not ``in``: see h1_exchange._head
        raise BadRequest(400, "fragment in the request target")
    raw_path, _, query_string = target.partition(b"?")
    return raw_path, query_string


def _refuse_header_block(block: bytes) -> None:
    """A block the one scan did not take whole: which line is wrong, and how (raises)."""
    for line in block.split(b"\r\n"):
        if _HEADER.fullmatch(line) is None:
            if line[:1] in (b" ", b"\t"):
                raise BadRequest(400, "obsolete line folding")
            raise BadRequest(400, "malformed header line")
    # not reached: a block of valid lines is one match a line, and a bare CR or LF makes
    # its line invalid above
    raise BadRequest(400, "malformed header line")


class ChunkedBody(ChunkedDecoder):
    """Incremental decoder of a chunked request body (:mod:`serving.chunked`, trailer lines
    checked as header fields). ``feed(data)`` returns the body bytes in ``data`` and how many
    bytes of ``data`` it used (the rest belongs to the next request once ``done``); raises
    ``BadRequest`` on malformed framing."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(trailer_field=_HEADER.fullmatch)

    def feed(self, data: bytes) -> tuple[bytes, int]:
        out: list[bytes] = []
        try:
            used = self.decode(data, out)
        except ChunkedError as exc:
            raise BadRequest(400, str(exc)) from None
        return b"".join(out), used
