"""RESP2, the Redis wire protocol, as the budget store's client needs it: commands encoded as
arrays of bulk strings, replies parsed incrementally (a reply split anywhere across reads is
reassembled), error replies mapped to redis-py's exception types."""

from __future__ import annotations

from typing import Any

from redis.exceptions import AuthenticationError, NoScriptError, ResponseError

__all__ = ["ErrorReply", "RespParser", "encode_command"]


def encode_command(args: tuple[Any, ...]) -> bytes:
    """One command as a RESP array of bulk strings (str, bytes, int and float arguments)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode("utf-8")
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            data = repr(arg).encode("ascii")
        else:
            raise TypeError(f"redis argument of type {type(arg).__name__}: {arg!r}")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class ErrorReply:
    """An error reply, delivered to its caller as an exception."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def exception(self) -> Exception:
        if self.message.startswith("NOSCRIPT"):
            return NoScriptError(self.message)
        if self.message.startswith(("NOAUTH", "WRONGPASS")):
            return AuthenticationError(self.message)
        return ResponseError(self.message)


class RespParser:
    """Incremental RESP2 parser: :meth:`feed` bytes, then :meth:`replies` the complete ones
    (an error reply is an :class:`ErrorReply`; nil is None)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def replies(self) -> list[Any]:
        out = []
        while True:
            start = self._pos
            try:
                reply = self._parse()
            except IndexError:  # incomplete: wait for more bytes
                self._pos = start
                break
            out.append(reply)
        if self._pos:
            del self._buffer[:self._pos]
            self._pos = 0
        return out

    def _line(self) -> bytes:
        end = self._buffer.find(b"\r\n", self._pos)
        if end < 0:
            raise IndexError
        line = bytes(self._buffer[self._pos:end])
        self._pos = end + 2
        return line

    def _parse(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            end = self._pos + length
            if len(self._buffer) < end + 2:
                raise IndexError
            data = bytes(self._buffer[self._pos:end])
            self._pos = end + 2
            return data.decode("utf-8", "replace")
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            return ErrorReply(rest.decode("utf-8", "replace"))
        if kind == b"*":
            count = int(rest)
            if count < 0:
                return None
            return [self._parse() for _ in range(count)]
        raise ValueError(f"redis protocol error: unexpected reply type {line[:20]!r}")
