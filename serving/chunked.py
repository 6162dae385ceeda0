"""One incremental decoder of HTTP/1.1 chunked framing (RFC 9112 §7.1) for both of kvguard's
HTTP halves: request bodies on its server (``serving.h1_head.ChunkedBody``) and upstream
response bodies in the proxy's client (``guard.proxy.h1_message.ChunkedDecoder``).

Bytes may arrive split anywhere. :meth:`ChunkedDecoder.decode` appends the body bytes it finds
to a list as they come (a chunk's data is handed on per read, never held back until the chunk
ends; a read that is all data is passed on without a copy) and returns how many bytes of its
input it used: all of them, unless the body ended inside them.

Strict on both sides, because a framing two parsers read differently is how requests are
smuggled and responses split:

- a chunk size is 1–15 hex digits and nothing else (``int(x, 16)`` alone also takes ``0x1a``,
  ``+1a``, ``1_a`` and surrounding whitespace), optionally followed by spaces or tabs and
  ``;name[=value]`` extensions (ignored, but each a token, with a token or a closed quoted
  string for its value: an unclosed quote is where parsers disagree on where a line ends);
- every size and trailer line ends in CRLF and holds no other CR; a chunk's data is followed
  by exactly CRLF;
- a size line is at most ``MAX_SIZE_LINE_BYTES`` long, the trailer section at most
  ``max_trailer_bytes`` in all.

The one policy that differs (``trailer_field``): a server validates each trailer line as a
header field (a request's trailers are the client's input), while the proxy's client only
bounds them (an upstream's trailers are dropped unread). Errors are :class:`ChunkedError`;
each side turns them into its own (a 400 on the server, an upstream failure in the client).
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["ChunkedDecoder", "ChunkedError", "MAX_SIZE_LINE_BYTES", "MAX_TRAILER_BYTES"]

MAX_SIZE_LINE_BYTES = 1024  # a chunk-size line with its extensions
MAX_TRAILER_BYTES = 16 * 1024  # the whole trailer section
_MAX_SIZE_DIGITS = 15

_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
# a plain size line (no extensions, no padding): the fast path's, for a chunk whole in one read
_PLAIN_SIZE_LINE = re.compile(rb"[0-9a-fA-F]{1,%d}\r\n" % _MAX_SIZE_DIGITS)
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
# a size line without its CRLF: the size, then any extensions (RFC 9112 section 7.1.1)
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,%d})[ \t]*(?:;[ \t]*%s(?:[ \t]*=[ \t]*(?:%s|%s))?[ \t]*)*"
                        % (_MAX_SIZE_DIGITS, _TOKEN, _TOKEN, _QUOTED))


class ChunkedError(ValueError):
    """Malformed or oversized chunked framing."""


class ChunkedDecoder:
    """Removes chunked framing from bytes fed in any split; ``done`` once the last chunk and
    its trailer section are in."""

    __slots__ = ("done", "_state", "_left", "_line", "_trailer_bytes", "_trailer_field",
                 "_max_trailer_bytes")

    def __init__(self, *, trailer_field: Callable[[bytes], object] | None,
                 max_trailer_bytes: int = MAX_TRAILER_BYTES) -> None:
        """``trailer_field(line)``: truthy when a trailer line is a well-formed header field
        (``None``: trailers are bounded, not read)."""
        self.done = False
        self._state = _SIZE
        self._left = 0  # data bytes left in the current chunk; CRLF bytes left after it
        self._line = b""  # a size or trailer line split across reads
        self._trailer_bytes = 0
        self._trailer_field = trailer_field
        self._max_trailer_bytes = max_trailer_bytes

    def decode(self, data: bytes, out: list[bytes]) -> int:
        """Append the body bytes in ``data`` to ``out``; return how many bytes of ``data`` were
        used (``len(data)`` unless the body ended inside it). Raises :class:`ChunkedError`."""
        pos, end = 0, len(data)
        plain_size_line = _PLAIN_SIZE_LINE.match
        while pos < end:
            state = self._state
            if state == _SIZE and not self._line:
                # the fast path: a chunk whole in this read, behind a plain size line, is one
                # slice (a streamed event arrives so: one chunk per read); anything else, the
                # last chunk included, takes the general path below
                line = plain_size_line(data, pos)
                if line is not None:
                    start = line.end()
                    stop = start + int(data[pos:start - 2], 16)
                    if start < stop and stop + 2 <= end and data[stop] == 0x0D \
                            and data[stop + 1] == 0x0A:
                        out.append(data[start:stop])
                        pos = stop + 2
                        continue
            if state == _DATA:
                take = min(self._left, end - pos)
                out.append(data if take == end else data[pos:pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._state, self._left = _DATA_END, 2
            elif state == _DATA_END:  # the CRLF after a chunk's data (it may arrive split)
                if data[pos] != (0x0D if self._left == 2 else 0x0A):
                    raise ChunkedError("chunk data not followed by CRLF")
                pos += 1
                self._left -= 1
                if not self._left:
                    self._state = _SIZE
            elif state == _DONE:
                break
            else:  # _SIZE or _TRAILER: one CRLF-terminated line
                limit = MAX_SIZE_LINE_BYTES if state == _SIZE else self._max_trailer_bytes
                line_end = data.find(b"\n", pos)
                if line_end < 0:
                    self._line += data[pos:]
                    if len(self._line) > limit:
                        raise ChunkedError("chunk size line or trailer too long")
                    return end
                line = self._line + data[pos:line_end + 1]
                self._line = b""
                pos = line_end + 1
                if len(line) > limit or not line.endswith(b"\r\n") or \
                        line.find(b"\r", 0, len(line) - 2) >= 0:  # find: see h1_exchange._head
                    raise ChunkedError("malformed chunk size line or trailer")
                if state == _SIZE:
                    self._size(line[:-2])
                else:
                    self._trailer(line[:-2])
        return pos

    def _size(self, line: bytes) -> None:
        match = _SIZE_LINE.fullmatch(line)
        if match is None:
            raise ChunkedError(f"invalid chunk size line {line[:40]!r}")
        self._left = int(match[1], 16)
        self._state = _DATA if self._left else _TRAILER

    def _trailer(self, line: bytes) -> None:
        if not line:
            self._state, self.done = _DONE, True
            return
        self._trailer_bytes += len(line) + 2
        if self._trailer_bytes > self._max_trailer_bytes:
            raise ChunkedError("trailer section too long")
        if self._trailer_field is not None and not self._trailer_field(line):
            raise ChunkedError("malformed trailer field")
