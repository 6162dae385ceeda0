"""The one chunked-framing decoder both HTTP halves use (serving.chunked): the server's request
bodies (trailers checked as header fields) and the proxy client's upstream bodies (trailers
bounded, dropped)."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.proxy.h1_message import ChunkedDecoder as UpstreamChunks
from guard.proxy.h1_message import MessageError
from serving.chunked import MAX_TRAILER_BYTES, ChunkedDecoder, ChunkedError
from serving.h1_head import BadRequest, ChunkedBody

FIELD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[ \t]*[^\x00-\x08\x0a-\x1f\x7f]*").fullmatch
# chunks whose data looks like framing (CRLFs, "0"), one with an extension, then a trailer
PIECES = [b"data: ", b'{"text": "a\\r\\n0\\r\\n"}\r\n\n', b"\r\n\r", b"0\r\n\r\n"]
BODY = (b"".join(b"%x%s\r\n%s\r\n" % (len(p), b" ;name=value" if i == 1 else b"", p)
                 for i, p in enumerate(PIECES)) + b"0\r\nx-trailer: 1\r\n\r\n")
NEXT = b"POST /next HTTP/1.1\r\n"


def decoders():
    return [ChunkedDecoder(trailer_field=FIELD), ChunkedDecoder(trailer_field=None)]


def _decode(decoder, pieces):
    out, used = [], 0
    for piece in pieces:
        assert not decoder.done
        used += decoder.decode(piece, out)
    return b"".join(out), used


@pytest.mark.parametrize("strict", [True, False])
def test_any_split_decodes_the_same_and_stops_at_the_body_end(strict):
    whole = BODY + NEXT
    for split in range(1, len(whole)):
        decoder = ChunkedDecoder(trailer_field=FIELD if strict else None)
        out, used = _decode(decoder, [whole[:split]])
        if not decoder.done:
            more, rest = _decode(decoder, [whole[split:]])
            out, used = out + more, used + rest
        assert decoder.done and out == b"".join(PIECES), split
        assert used == len(BODY), split  # what follows is the next message's, untouched


def test_a_read_that_is_all_data_is_handed_on_without_a_copy():
    decoder = ChunkedDecoder(trailer_field=None)
    out = []
    assert decoder.decode(b"a\r\n01234", out) == 8
    data = b"56789"
    decoder.decode(data, out)
    assert out[-1] is data


@pytest.mark.parametrize("bad", [
    b"0x5\r\nhello\r\n", b"+5\r\nhello\r\n", b"5_0\r\n", b" 5\r\nhello\r\n",  # not plain hex
    b"\r\n", b"zz\r\n", b"1" * 16 + b"\r\n",
    b"5\nhello\r\n", b"5\r\r\nhello", b"5;a\rb\r\nhello",  # a line not ended by exactly CRLF
    b"5\r\nhelloXY", b"5\r\nhello\rX",  # chunk data not followed by CRLF
    b"5" + b" " * 1030 + b"\r\n",  # an oversized size line
])
def test_bad_framing_is_refused_on_both_sides(bad):
    for decoder in decoders():
        with pytest.raises(ChunkedError):
            decoder.decode(bad, [])


def test_an_endless_size_line_is_refused_before_it_is_whole():
    for decoder in decoders():
        with pytest.raises(ChunkedError):
            for _ in range(3):
                decoder.decode(b"0" * 1000, [])


def test_trailers_are_checked_as_fields_only_where_asked_and_bounded_everywhere():
    odd = b"0\r\nnot a field\r\n\r\n"
    with pytest.raises(ChunkedError):
        ChunkedDecoder(trailer_field=FIELD).decode(odd, [])
    lenient = ChunkedDecoder(trailer_field=None)
    assert lenient.decode(odd, []) == len(odd) and lenient.done
    huge = b"0\r\n" + b"x-pad: " + b"a" * 1000 + b"\r\n"
    for decoder in decoders():
        with pytest.raises(ChunkedError):
            decoder.decode(huge * (MAX_TRAILER_BYTES // 1000 + 1), [])


def test_each_side_raises_its_own_error_and_reports_its_own_way():
    with pytest.raises(BadRequest) as bad:
        ChunkedBody().feed(b"0x5\r\nhello\r\n")
    assert bad.value.status == 400
    with pytest.raises(MessageError):
        UpstreamChunks().feed(b"0x5\r\nhello\r\n")
    body, used = ChunkedBody().feed(BODY + NEXT)  # the server: bytes used, the rest is next's
    assert body == b"".join(PIECES) and used == len(BODY)
    upstream = UpstreamChunks()
    assert b"".join(upstream.feed(BODY + b"junk")) == b"".join(PIECES)
    assert upstream.done and upstream.extra  # the client: bytes after the end break the link


def test_whole_chunks_behind_plain_size_lines_are_sliced_without_the_line_parser(monkeypatch):
    """The fast path: a read of whole chunks (a streamed event per read) is sliced directly;
    the last chunk, an extension or a chunk split across reads go through the general path."""
    def no_line_parser(self, line):
        raise AssertionError(f"general path for {line!r}")

    monkeypatch.setattr(ChunkedDecoder, "_size", no_line_parser)
    decoder, out = ChunkedDecoder(trailer_field=None), []
    data = b"5\r\nhello\r\n1A\r\n" + b"z" * 26 + b"\r\n"
    assert decoder.decode(data, out) == len(data)
    assert out == [b"hello", b"z" * 26] and not decoder.done
    for general in (b"0\r\n\r\n", b"5;x=1\r\nhello\r\n", b"5\r\nhel"):
        with pytest.raises(AssertionError, match="general path"):
            ChunkedDecoder(trailer_field=None).decode(general, [])


@given(st.lists(st.binary(min_size=1, max_size=40), max_size=6),
       st.lists(st.sampled_from([b"", b";ext=1", b" ", b"\t;a"]), min_size=6, max_size=6),
       st.lists(st.integers(min_value=1, max_value=400), max_size=5), st.booleans())
def test_any_chunks_in_any_split_decode_to_their_data(payloads, extensions, cuts, upper):
    body = b"".join(b"%s%s\r\n%s\r\n" % ((b"%X" if upper else b"%x") % len(p), extensions[i], p)
                    for i, p in enumerate(payloads)) + b"0\r\n\r\n"
    points = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    reads = [body[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    decoder, out = ChunkedDecoder(trailer_field=None), []
    assert sum(decoder.decode(read, out) for read in reads) == len(body)
    assert decoder.done and b"".join(out) == b"".join(payloads)
