"""Decoding an untrusted JSON request body: a nesting-depth limit, then ``json.loads``.

Python's JSON decoder recurses once per nesting level, so a 2 KB body of a thousand ``[``
raises ``RecursionError`` from deep inside the parser. ``nesting_depth_exceeds`` answers the
question before parsing, cheaply: the count of ``[`` and ``{`` bounds the depth from above, so
only a body with more brackets than the limit is scanned (strings skipped, in C by ``re``).

``decode_json_object(raw, max_depth)`` returns the body as a dict or raises ``JsonBodyError``
(code ``invalid_json``: a body nested too deeply is JSON we refuse to parse).

``loads(raw)`` is the parse the guard's hot paths use (request bodies, replica state documents):
orjson first (one C call); the stdlib for
what strict RFC 8259 refuses and Python's JSON allows (NaN, lone surrogate escapes, UTF-16...)
and wherever an integer may pass 64 bits (orjson would make it a float). Errors are the stdlib's
(``ValueError``, ``UnicodeDecodeError``, ``RecursionError``).
"""

from __future__ import annotations

import json
import re

import orjson

__all__ = ["MAX_JSON_DEPTH", "JsonBodyError", "decode_json_object", "loads",
           "nesting_depth_exceeds"]

MAX_JSON_DEPTH = 64  # OpenAI bodies nest ~5 levels; JSON schemas in tools rarely pass 20

# a JSON string (skipped whole), or one structural bracket
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
# 18 digits always fit in 64 bits: a run of 19 is looked for in the body with every digit
# mapped to "0", "." kept and every other byte mapped to " " (two linear C passes; a regex for
# the run restarts at every digit of every number, and state documents are full of 17-digit
# floats). A float's fraction runs to 19-20 digits below 0.01 (0.007123456789012345: every
# step duration in a state delta), and orjson parses it as the stdlib does: when every run
# found follows a "." (as many runs as runs after a ".": each shorter than 38 digits), orjson
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else b if b == 0x2E else 0x20
                        for b in range(256))
_LONG_DIGIT_RUN = b"0" * 19
_LONG_FRACTION = b"." + _LONG_DIGIT_RUN
_OPENERS = frozenset(b"[{")
_CLOSERS = frozenset(b"]}")


class JsonBodyError(ValueError):
    """The body is not a JSON object we accept (OpenAI error code ``invalid_json``)."""

    code = "invalid_json"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def loads(raw: bytes) -> object:
    """``raw`` parsed as JSON: orjson where it parses exactly as the stdlib would, else the
    stdlib (see the module docstring)."""
    mapped = raw.translate(_DIGITS_AS_ZERO)
    if _LONG_DIGIT_RUN not in mapped or \
            mapped.count(_LONG_DIGIT_RUN) == mapped.count(_LONG_FRACTION):
        try:
            return orjson.loads(raw)
        except ValueError:
            pass
    return json.loads(raw)


def nesting_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether arrays and objects in ``raw`` nest deeper than ``max_depth`` (brackets inside
    strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for match in _TOKENS.finditer(raw):
        char = raw[match.start()]
        if char in _OPENERS:
            depth += 1
            if depth > max_depth:
                return True
        elif char in _CLOSERS:
            depth -= 1
    return False


def decode_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """``raw`` parsed as a JSON object, or ``JsonBodyError``."""
    if nesting_depth_exceeds(raw, max_depth):
        raise JsonBodyError(f"the JSON body nests deeper than {max_depth} levels")
    try:
        body = json.loads(raw)
    except RecursionError:  # a backstop: the scan above should have caught it
        raise JsonBodyError("the JSON body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonBodyError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise JsonBodyError("The request body must be a JSON object.")
    return body
