"""serving.h1_head: the one-scan header parser against the per-line rule it implements."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.h1_head import _HEADER, MAX_HEADERS, BadRequest, parse_head


def _reference(block: bytes) -> list[tuple[bytes, bytes]]:
    """Every line of the block a whole field line (``_HEADER``), else 400."""
    headers = []
    for line in block.split(b"\r\n"):
        match = _HEADER.fullmatch(line)
        if match is None:
            raise BadRequest(400, "obsolete line folding" if line[:1] in (b" ", b"\t")
                             else "malformed header line")
        headers.append((match[1].lower(), match[2]))
    return headers


# field-line pieces, with the bytes a parser must refuse among them (bare CR / LF, NUL, DEL,
# a space before the colon, a leading fold)
_PIECES = st.sampled_from([b"Host", b"x-a", b"X-B", b":", b": ", b" ", b"\t", b"v", b"1",
                           b"a b", b"\r", b"\n", b"\r\n", b"\x00", b"\x7f", b"\xe9", b"@",
                           b"content-length", b"Host: h"])
_LINE = st.lists(_PIECES, min_size=0, max_size=6).map(b"".join)


@settings(max_examples=600, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=5))
def test_the_header_scan_accepts_and_refuses_exactly_what_the_per_line_rule_does(lines):
    block = b"\r\n".join(lines)
    head = b"GET / HTTP/1.1\r\n" + block
    try:
        expected = _reference(block)
    except BadRequest as exc:
        with pytest.raises(BadRequest) as refused:
            parse_head(head)
        if head.count(b"\r\n") <= MAX_HEADERS:
            assert refused.value.status == exc.status
        return
    try:
        request = parse_head(head)
    except BadRequest as exc:  # a valid block may still fail on host / framing rules
        assert exc.reason not in ("malformed header line", "obsolete line folding")
        return
    assert request.headers == expected


def test_a_bare_lf_between_valid_lines_is_refused():
    with pytest.raises(BadRequest, match="malformed header line"):
        parse_head(b"GET / HTTP/1.1\r\nhost: h\nx-a: 1")


def test_values_are_stripped_and_names_lower_cased():
    request = parse_head(b"GET /p?q=1 HTTP/1.1\r\nHost:  h \r\nX-Thing:\tv w\t")
    assert request.headers == [(b"host", b"h"), (b"x-thing", b"v w")]
    assert (request.path, request.query_string) == ("/p", b"q=1")


def test_a_head_without_header_lines():
    request = parse_head(b"GET / HTTP/1.0")
    assert request.headers == [] and not request.keep_alive
    with pytest.raises(BadRequest, match="host"):
        parse_head(b"GET / HTTP/1.1")


@pytest.mark.parametrize(("version", "value", "keep_alive"), [
    ("1.1", "keep-alive", True), ("1.1", "close", False), ("1.1", "Close", False),
    ("1.1", "te, close", False), ("1.1", "upgrade", True),
    ("1.0", "keep-alive", True), ("1.0", "Keep-Alive", True), ("1.0", "close", False),
    ("1.0", "te , keep-alive", True), ("1.0", "keep-alive, close", False), ("1.0", "te", False),
])
def test_connection_tokens_set_keep_alive(version, value, keep_alive):
    """One token (the usual value) or a list: ``close`` anywhere closes; ``keep-alive`` keeps
    an HTTP/1.0 connection; HTTP/1.1 keeps it unless told to close."""
    request = parse_head(f"GET / HTTP/{version}\r\nhost: h\r\nconnection: {value}".encode())
    assert request.keep_alive is keep_alive
